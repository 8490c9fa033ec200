"""Time the CPU forward paths: prefill of an N-token prompt and greedy decode, one thread by default.

    python3 tools/cpu_bench.py [--model DIR] [--prompt-tokens 4096] [--decode 128]
                               [--backend fast|reference] [--threads 1] [--save-ids FILE] [--json]

The prompt is real Python code (this Python's standard-library sources, a fixed order) cut
to exactly --prompt-tokens tokens of the model's tokenizer; --save-ids writes those ids so a
baseline outside this repository (transformers + torch, which the design card keeps out of
it: docs/PERF.md, "CPU path") can run the very same tokens. Prefill goes through the engine's
prefill (engine.prefill_chunk tokens per forward, as the server does); decode is plain greedy
(no speculation), timed after the prefill, plus the speculative decoder's rate for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def code_text(n_bytes: int) -> str:
    import argparse as m1, dataclasses as m2, inspect as m3, json.decoder as m4, typing as m5  # noqa: E401
    import inspect

    text = ""
    for module in (m1, m2, m3, m4, m5):
        text += inspect.getsource(module)
        if len(text.encode()) >= n_bytes:
            break
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: the bundled one)")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=128, help="greedy tokens to time after the prefill")
    ap.add_argument("--backend", choices=["fast", "reference"], default="fast")
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads (set before numpy loads)")
    ap.add_argument("--save-ids", type=Path, help="write the prompt ids (JSON list) here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)

    from q27py import DEFAULT_MODEL_DIR
    from q27py.config import Q27Config
    from q27py.engine.api import SamplingParams
    from q27py.engine.decoder import Decoder, prefill
    from q27py.engine.engine import load_model
    from q27py.engine.spec import SpecDecoder
    from q27py.tokenizer import Tokenizer

    cfg = Q27Config()
    cfg.engine.model_dir = args.model or DEFAULT_MODEL_DIR
    cfg.engine.backend = args.backend
    tok = Tokenizer.from_model_dir(cfg.engine.model_dir)
    ids = tok.encode(code_text(8 * args.prompt_tokens), allow_special=False)[: args.prompt_tokens]
    assert len(ids) == args.prompt_tokens, "prompt text too short"
    if args.save_ids:
        args.save_ids.write_text(json.dumps(ids))
    t0 = time.perf_counter()
    model = load_model(cfg)
    load_s = time.perf_counter() - t0
    prefill(model, model.new_state(), ids[:64], cfg.engine.prefill_chunk)  # warm-up (page in weights)

    # Wall time and this process's CPU time: on a shared machine the CPU time is what the
    # single thread really spent (the wall clock also counts waiting for a core).
    best = best_cpu = None
    for _ in range(2):
        state = model.new_state()
        t0, c0 = time.perf_counter(), time.process_time()
        logits = prefill(model, state, ids, cfg.engine.prefill_chunk)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        best = dt if best is None else min(best, dt)
        best_cpu = dc if best_cpu is None else min(best_cpu, dc)
    greedy = SamplingParams(temperature=0.0)

    def timed(decoder):
        st = model.new_state()
        prefill(model, st, ids[:-1], cfg.engine.prefill_chunk)  # leave one prompt token to the decoder
        t0, c0 = time.perf_counter(), time.process_time()
        out = [t for step in decoder.run(st, ids, args.decode + 1, greedy) for t in step]
        return out, time.perf_counter() - t0, time.process_time() - c0

    # run() feeds the one remaining prompt token (a 1-token forward, as costly as a decode step),
    # then decodes: decode + 1 tokens from decode + 1 single-token forwards.
    plain, plain_s, plain_cpu = timed(Decoder(model, prefill_chunk=cfg.engine.prefill_chunk))
    spec_tokens, spec_s, spec_cpu = (timed(SpecDecoder(model, cfg.spec, prefill_chunk=cfg.engine.prefill_chunk))
                                     if model.has_mtp else ([], 0.0, 0.0))
    res = {
        "model": Path(cfg.engine.model_dir).name, "backend": args.backend, "threads": args.threads,
        "prompt_tokens": len(ids), "load_s": round(load_s, 3),
        "prefill_s": round(best, 3), "prefill_tok_s": round(len(ids) / best, 1),
        "prefill_cpu_s": round(best_cpu, 3), "prefill_tok_per_cpu_s": round(len(ids) / best_cpu, 1),
        "decode_tokens": args.decode, "decode_tok_s": round(len(plain) / plain_s, 1),  # one forward per token
        "decode_tok_per_cpu_s": round(len(plain) / plain_cpu, 1),
        "spec_decode_tok_s": round(len(spec_tokens) / spec_s, 1) if spec_s else None,
        "spec_decode_tok_per_cpu_s": round(len(spec_tokens) / spec_cpu, 1) if spec_s else None,
        "spec_equals_plain": spec_tokens == plain if spec_s else None,
        "first_tokens": plain[:16],
        "prefill_argmax_is_first_token": int(logits.argmax()) == plain[0],
    }
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:18s} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
