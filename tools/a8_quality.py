"""Quality gate of the a8 GEMV tier (int8 activations, cuda/gemv.cu gemv8_*) against the bf16-
activation GEMV (v1) on a trained model, on the decode path (teacher-forced in 16-lane forwards, the
widths where the GEMV -- and so a8 -- runs; prefill chunks of >= 32 tokens take the GEMM in both):

    PYTHONPATH=. python3 tools/a8_quality.py [--model DIR] [--tiers q4s q8] [--tokens 2048]

Per tier: mean and p99.9 KL(v1 || a8) of the next-token distributions, top-1 agreement, the text's
mean NLL under each, and whether 128 greedy tokens of the gate prompt (gates/run.py) agree.
The text is this repository's own source (held out from the tiny models' training data).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from q27py import DEFAULT_MODEL_DIR  # noqa: E402


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def score(model, ids: list[int]) -> np.ndarray:
    st = model.new_state()
    out = []
    for s in range(0, len(ids) - 1, 16):
        piece = ids[s:s + 16]
        out.append(model.forward(st, piece, logits_rows="all").logits.astype(np.float32))
    return np.concatenate(out)[: len(ids) - 1]


def greedy(model, prompt: list[int], n: int) -> list[int]:
    st = model.new_state()
    lg = model.forward(st, prompt[:16], logits_rows="last").logits[-1]
    for s in range(16, len(prompt), 16):
        lg = model.forward(st, prompt[s:s + 16], logits_rows="last").logits[-1]
    got = []
    for _ in range(n):
        t = int(np.argmax(lg))
        got.append(t)
        lg = model.forward(st, [t], logits_rows="last").logits[-1]
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--tiers", nargs="+", default=["q4s", "q8"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from gates.run import TINY_PROMPT
    from q27py.bench.shortbench import chat_prompt
    from q27py.gpu import kernels as K
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint
    from q27py.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(Path(args.model))
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "q27py" / "engine").glob("*.py")))
    ids = tok.encode(text)[: args.tokens]
    prompt = tok.encode(chat_prompt(TINY_PROMPT))
    results = {}
    for tier in args.tiers:
        w = from_checkpoint(Checkpoint.open(Path(args.model)), tier, progress=False)
        logits, gen = {}, {}
        for impl in ("v1", "a8"):
            K.set_gemv_impl(impl)
            m = FastModel(w, max_context=len(ids) + 256, kv_dtype="bf16", chunk=64)
            logits[impl] = score(m, ids)
            gen[impl] = greedy(m, prompt, 128)
            del m
        K.set_gemv_impl("v1")
        lp, lq = _log_softmax(logits["v1"]), _log_softmax(logits["a8"])
        kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
        tgt = np.asarray(ids[1:])
        nll = {k: float(-v[np.arange(len(tgt)), tgt].mean()) for k, v in (("v1", lp), ("a8", lq))}
        first_diff = next((i for i, (a, b) in enumerate(zip(gen["v1"], gen["a8"])) if a != b), None)
        r = {"positions": int(len(tgt)), "kl_mean": float(kl.mean()), "kl_p999": float(np.quantile(kl, 0.999)),
             "kl_max": float(kl.max()), "top1_agree": float((lp.argmax(-1) == lq.argmax(-1)).mean()),
             "nll_v1": nll["v1"], "nll_a8": nll["a8"], "greedy_128_equal": gen["v1"] == gen["a8"],
             "greedy_first_diff": first_diff}
        results[tier] = r
        print(f"{tier}: {r['positions']} positions, KL mean {r['kl_mean']:.2e} p99.9 {r['kl_p999']:.2e} max "
              f"{r['kl_max']:.2e}, top-1 agree {r['top1_agree']:.4f}, NLL v1 {r['nll_v1']:.4f} a8 {r['nll_a8']:.4f}, "
              f"greedy 128 equal {r['greedy_128_equal']} (first diff {first_diff})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
