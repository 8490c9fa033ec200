"""`q27py bench`: benchmarks on the CUDA fast path.

  q27py bench --random-weights 27b [--tier q4s] [--json]   full 27B shapes, random weights made on the GPU
  q27py bench shortbench [--model DIR] [--json]            5 short prompts x 128 tokens through the engine
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from q27py.errors import Q27Error


def add_arguments(p) -> None:
    from q27py.gpu.weights import TIERS

    p.add_argument("suite", nargs="?", choices=["shortbench"], help="shortbench (default: --random-weights run)")
    p.add_argument("--random-weights", choices=["27b"], help="full Qwen3.6-27B shapes with seeded random weights")
    p.add_argument("--tier", choices=sorted(TIERS), default=None,
                   help="weight tier (random weights: default q4s; shortbench: the checkpoint's own bf16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="fewer points: decode at 2K, widths 1/8/16, prefill 2K")
    p.add_argument("--model", type=Path, default=None, help="model directory for shortbench")
    p.add_argument("--tokens", type=int, default=128, help="tokens per shortbench prompt")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    if args.suite == "shortbench":
        from q27py.bench.shortbench import run_shortbench
        from q27py.config import Q27Config, apply_env, apply_overrides
        from q27py.engine.engine import LocalEngine

        cfg = apply_env(Q27Config())
        apply_overrides(cfg.engine, {"model_dir": args.model, "device": "cuda", "tier": args.tier})
        result = run_shortbench(LocalEngine.load(cfg), args.tokens, log)
    elif args.random_weights:
        from q27py.bench.random_weights import Bench

        bench = Bench(tier=args.tier or "q4s", seed=args.seed, log=log)
        if args.quick:
            bench.verify = _narrow(bench.verify)
            result = bench.run(decode_ctx=(2048,), prefill_lens=(2048,), mem_ctx=(2048, 32768))
        else:
            result = bench.run()
    else:
        raise Q27Error("choose a benchmark: --random-weights 27b, or shortbench")
    if args.json:
        print(json.dumps(result, indent=1, default=float))
    return 0


def _narrow(verify):
    return lambda ctx=2048, widths=(1, 8, 16): verify(ctx, widths)
