"""Prefill attention alone at the 27B head shapes, v1 / v2 / v3 (q27py/bench/attn_prefill.py): 8K and
32K prefills in 4096-lane chunks and a warm 512-lane turn over 25K cached keys, TFLOP/s against
790. JSON to $OUT/attn_prefill.json when OUT is set.

    PYTHONPATH=. python3 tools/bench_attn_prefill.py [--kv bf16 fp8] [--impl v1 v2 v3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from q27py.bench.attn_prefill import attention_prefill_timing
    from q27py.gpu.runtime import Runtime

    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--impl", nargs="+", default=["v1", "v2", "v3", "v3ws", "v3pipe"])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    res = {"device": Runtime.get().describe(), "rows": []}
    for kv in args.kv:
        res["rows"] += attention_prefill_timing(tuple(args.impl), kv, reps=args.reps,
                                                log=lambda *a: print(*a, flush=True))
    out = os.environ.get("OUT")
    if out:
        Path(out, "attn_prefill.json").write_text(json.dumps(res, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
