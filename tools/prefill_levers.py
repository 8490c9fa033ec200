"""The prefill levers of issue 14, A/B in one process (one call): 8K (and --tokens) prefills of the 27B random-weights
bench model under named configurations, alternated rep by rep so clock and thermal drift fall on all of them alike;
prints the median tok/s of each and its ratio to the first.

Levers (each a module default the engine sets from EngineConfig at load):
  rope    kernels.ROPE_ROWS_MIN: qk_norm_rope_store's warp-per-head form on prefill chunks (bitwise), or the block form
  small   kernels.PREFILL_SMALL_GEMM: the GDN gates' ab route ("f32" SGEMM, "bf16x3" cuBLAS, "bf16x3f" fused kernel)
  gateup  kernels.PREFILL_GATE_UP_BF16: the MLP's gate_up rows as bf16 before SwiGLU (a tolerance-class change)
  gdn1    kernels.GDN2_OUT_TF32: the chunked2 GDN output pass in one TF32 product a mma (the "tf32 out" class)
  gdnst   kernels.GDN2_STATE_TF32: the chunked2 GDN pre-pass and state recurrence in one TF32 product a mma (the
          "tf32 state" class)

    PYTHONPATH=. Q27_PREFILL_WEIGHT_CACHE_GB=60 python3 tools/prefill_levers.py [--reps 3] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> (rope rows, small GEMM route, gate_up bf16, GDN output pass in one TF32 product, GDN pre-pass and state
# recurrence in one TF32 product)
CONFIGS = {
    "before": (False, "f32", False, False, False),
    "rope": (True, "f32", False, False, False),
    "rope+bf16x3f": (True, "bf16x3f", False, False, False),
    "rope+bf16x3f+gateup": (True, "bf16x3f", True, False, False),
    "rope+bf16x3f+gateup+gdn1": (True, "bf16x3f", True, True, False),
    "rope+bf16x3f+gateup+gdnst": (True, "bf16x3f", True, False, True),
    "rope+bf16x3f+gateup+gdn1+gdnst": (True, "bf16x3f", True, True, True),
}


def apply(K, cfg) -> None:
    rope, small, gateup, gdn1, gdnst = cfg
    K.ROPE_ROWS_MIN = 64 if rope else 1 << 30
    K.PREFILL_SMALL_GEMM = small
    K.PREFILL_GATE_UP_BF16 = gateup
    K.GDN2_OUT_TF32 = gdn1
    K.GDN2_STATE_TF32 = gdnst


def main() -> int:
    from q27py.bench.random_weights import Bench
    from q27py.gpu import kernels as K

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--chunk", type=int, default=4096,
                    help="tokens per prefill forward (EngineConfig.gpu_prefill_chunk; the model's scratch is sized by it, "
                         "so compare chunk sizes across processes)")
    args = ap.parse_args()
    b = Bench(tier="q4s", max_context=max(args.tokens) + 64, chunk=args.chunk, log=lambda *a: None)
    print(b.rt.describe().get("name", ""), f"chunk {args.chunk}", flush=True)
    for n in args.tokens:
        tps: dict[str, list[float]] = {c: [] for c in args.configs}
        for c in args.configs:  # untimed: each route's first sight (its module, expansions, scratch) out of the runs
            apply(K, CONFIGS[c])
            b.prefill(n)
        for _ in range(args.reps):
            for c in args.configs:
                apply(K, CONFIGS[c])
                tps[c].append(b.prefill(n)["tokens_per_s"])
        first = statistics.median(tps[args.configs[0]])
        for c in args.configs:
            med = statistics.median(tps[c])
            print(f"prefill {n} {c:<30} median {med:8.0f} tok/s  x{med / first:.4f}  "
                  f"(runs {' '.join(f'{x:.0f}' for x in tps[c])})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
