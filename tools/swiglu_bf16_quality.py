"""CPU study of a prefill lever (issue 14): cuBLAS writing the MLP's gate and up rows as bf16.

The CUDA prefill computes gate_up with cuBLAS into fp32 rows, then SwiGLU silu(gate) * up in fp32,
rounded once to bf16 (the down projection's input: cuda/dequant.cu swiglu_tiles_bf16). The variant
under study has cuBLAS write gate and up as bf16 (round to nearest even), then the same SwiGLU in
fp32 from those, rounded to bf16 as now. This measures what that does to the trained models'
next-token distributions, on the CPU fast path (q27py/model/fastcpu.py, fp32 throughout, bf16
checkpoint weights exactly), in three configurations of the MLP only:

    a  as shipped: gate, up, SwiGLU and the down input all fp32 (the CPU path rounds nothing)
    b  the down input rounded to bf16 after SwiGLU (what the GPU prefill does today)
    c  b + gate and up rounded to bf16 before SwiGLU (the lever)

The rounding lives in this tool only (a subclass overriding FastCPUModel._mlp); the engine is
untouched. Every MLP of the main stack is affected, at every position (prefill chunks of --chunk
tokens, as the GPU prefill runs them; the GEMM route of fastcpu throughout).

Text (held out: the tiny models ship no held-out split, so as tools/a8_quality.py and
q27py/bench/kv_quality.py do, text neither model was trained on): this repository's own source
(q27py/engine/*.py, a8_quality's text) and the shared reference notes on real agent traffic
(clients.md + peers.md, kv_quality's agent text), --tokens of each.

Per pair (c vs b: the lever's own error; b vs a: today's rounding; c vs a: both): mean / p99 /
p99.9 / max KL(ref || variant) of the next-token distribution, greedy top-1 agreement, the text's
mean NLL under each and the difference, and max |logit diff| over the logit scale (max |logit| of
the reference run over the same positions, as tests/gpu/test_forward.py measures it).

    PYTHONPATH=. OMP_NUM_THREADS=2 python3 tools/swiglu_bf16_quality.py [--tokens 3072] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from q27py import DEFAULT_MODEL_DIR  # noqa: E402
from q27py.io.safetensors import round_to_bf16  # noqa: E402
from q27py.model.fastcpu import FastCPUModel, silu  # noqa: E402

SHARED = next((p for p in (ROOT.parent / "shared", Path("/work/shared")) if p.is_dir()), ROOT.parent / "shared")
CONFIGS = ("a", "b", "c")
PAIRS = (("b", "c"), ("a", "b"), ("a", "c"))  # (reference, variant)


class SwigluStudyModel(FastCPUModel):
    """FastCPUModel whose MLP rounds as configuration `mode` says (a: unchanged)."""

    mode = "a"

    def _mlp(self, x: np.ndarray, p: str) -> np.ndarray:
        if self.mode == "a":
            return super()._mlp(x, p)
        gu = self._linear(x, p + "mlp.gate_up.weight")
        m = gu.shape[1] // 2
        g, u = gu[:, :m], gu[:, m:]
        if self.mode == "c":
            g, u = round_to_bf16(g), round_to_bf16(u)
        return self._linear(round_to_bf16(silu(g) * u), p + "mlp.down_proj.weight")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def texts(tok, n: int) -> dict[str, list[int]]:
    code = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "q27py" / "engine").glob("*.py")))
    agent = "\n\n".join((SHARED / "reference" / f).read_text(encoding="utf-8") for f in ("clients.md", "peers.md"))
    out = {"code": tok.encode(code)[:n], "agent": tok.encode(agent)[:n]}
    for k, v in out.items():
        assert len(v) == n, f"{k} text has only {len(v)} tokens"
    return out


def run_text(model: SwigluStudyModel, ids: list[int], chunk: int) -> dict:
    """Teacher-forced prefill of ids in chunks under all three configurations, compared chunk by chunk
    (no [T, V] array of all positions is kept). Returns per-position arrays."""
    states = {c: model.new_state() for c in CONFIGS}
    tgt_all = np.asarray(ids[1:])
    acc = {"nll": {c: [] for c in CONFIGS}, "top1": {c: [] for c in CONFIGS},
           "kl": {pr: [] for pr in PAIRS}, "dmax": {pr: [] for pr in PAIRS}, "scale": {c: 0.0 for c in CONFIGS}}
    for s in range(0, len(ids) - 1, chunk):
        piece = ids[s:s + chunk]
        tgt = tgt_all[s:s + len(piece)]
        rows = np.arange(len(tgt))
        logits, logp = {}, {}
        for c in CONFIGS:
            model.mode = c
            lg = model.forward(states[c], piece, logits_rows="all").logits.astype(np.float32)[: len(tgt)]
            logits[c], logp[c] = lg, _log_softmax(lg)
            acc["nll"][c].append(-logp[c][rows, tgt])
            acc["top1"][c].append(lg.argmax(-1))
            acc["scale"][c] = max(acc["scale"][c], float(np.abs(lg).max()))
        model.mode = "a"
        for r, v in PAIRS:
            acc["kl"][(r, v)].append(np.maximum((np.exp(logp[r]) * (logp[r] - logp[v])).sum(-1), 0.0))
            acc["dmax"][(r, v)].append(np.abs(logits[r].astype(np.float64) - logits[v]).max(-1))
    cat = lambda d: {k: np.concatenate(x) for k, x in d.items()}  # noqa: E731
    return {"nll": cat(acc["nll"]), "top1": cat(acc["top1"]), "kl": cat(acc["kl"]), "dmax": cat(acc["dmax"]),
            "scale": acc["scale"]}


def summarize(parts: list[dict]) -> dict:
    """Pair metrics over the concatenated positions of several texts."""
    nll = {c: np.concatenate([p["nll"][c] for p in parts]) for c in CONFIGS}
    top1 = {c: np.concatenate([p["top1"][c] for p in parts]) for c in CONFIGS}
    out = {"positions": int(nll["a"].size), "nll": {c: float(nll[c].mean()) for c in CONFIGS}}
    for r, v in PAIRS:
        kl = np.concatenate([p["kl"][(r, v)] for p in parts])
        # logit diff over the reference's logit scale, per text, worst text
        rel = max(float(p["dmax"][(r, v)].max()) / p["scale"][r] for p in parts)
        out[f"{v}_vs_{r}"] = {
            "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
            "kl_p999": float(np.quantile(kl, 0.999)), "kl_max": float(kl.max()),
            "top1_agree": float((top1[r] == top1[v]).mean()),
            "dnll_mean": float((nll[v] - nll[r]).mean()), "dnll_abs_mean": float(np.abs(nll[v] - nll[r]).mean()),
            "max_logit_diff_rel": rel,
        }
    return out


def fmt(name: str, s: dict) -> str:
    lines = [f"{name}: {s['positions']} positions, NLL a {s['nll']['a']:.5f} b {s['nll']['b']:.5f} c {s['nll']['c']:.5f}"]
    for r, v in PAIRS:
        m = s[f"{v}_vs_{r}"]
        lines.append(f"  {v} vs {r}: KL mean {m['kl_mean']:.2e} p99 {m['kl_p99']:.2e} p99.9 {m['kl_p999']:.2e} "
                     f"max {m['kl_max']:.2e}, top-1 agree {m['top1_agree']:.4f}, dNLL {m['dnll_mean']:+.2e} "
                     f"(|dNLL| {m['dnll_abs_mean']:.2e}), max |dlogit| / scale {m['max_logit_diff_rel']:.2e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from q27py.tokenizer import Tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=[str(DEFAULT_MODEL_DIR), str(SHARED / "models" / "q36-tiny-code")])
    ap.add_argument("--tokens", type=int, default=3072, help="tokens of each text (code, agent)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per forward)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = {}
    t00 = time.perf_counter()
    for md in map(Path, args.models):
        if not md.is_dir():
            print(f"{md}: not present, skipped")
            continue
        t0 = time.perf_counter()
        model = SwigluStudyModel.load(md)
        tok = Tokenizer.from_model_dir(md)
        per_text = {}
        for tname, ids in texts(tok, args.tokens).items():
            per_text[tname] = run_text(model, ids, args.chunk)
        res = {"all": summarize(list(per_text.values()))}
        res.update({k: summarize([v]) for k, v in per_text.items()})
        res["seconds"] = time.perf_counter() - t0
        results[md.name] = res
        for k in ("all", *per_text):
            print(fmt(f"{md.name} [{k}]", res[k]))
        print(f"  ({res['seconds']:.0f} s)", flush=True)
    print(f"total {time.perf_counter() - t00:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
