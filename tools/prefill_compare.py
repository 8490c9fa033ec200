"""Prefill tokens/s on the 27B shapes (q4s random weights) for each GDN prefill route x GEMM route,
in one process (the same weights and clocks for every row):

    PYTHONPATH=. python3 tools/prefill_compare.py [--tokens 8192 32768] [--gdn sequential chunked2]
        [--gemm auto fp8] [--chunk 4096] [--expand-ahead off on]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--gdn", nargs="+", default=["sequential", "chunked2"])
    ap.add_argument("--gemm", nargs="+", default=["auto"])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--expand-ahead", nargs="+", choices=["off", "on"], default=["off"],
                    help="EngineConfig.prefill_expand_ahead for the cuBLAS route (blas.ExpandAhead)")
    args = ap.parse_args(argv)
    from q27py.bench.random_weights import Bench
    from q27py.gpu import blas
    from q27py.gpu import kernels as K

    b = Bench(tier="q4s", max_context=max(args.tokens) + 64, chunk=args.chunk, log=lambda *a: None)
    rows = []
    for n in args.tokens:
        for gemm in args.gemm:
            for gdn in args.gdn:
                for ahead in args.expand_ahead:
                    K.GDN_PREFILL, K.PREFILL_GEMM = gdn, gemm
                    blas.set_expand_ahead(ahead == "on")
                    r = b.prefill(n)
                    rows.append({"tokens": n, "gdn": gdn, "gemm": gemm, "expand_ahead": ahead,
                                 "tokens_per_s": r["tokens_per_s"], "seconds": r["seconds"]})
                    print(f"prefill {n:6d}  gdn {gdn:<10} gemm {gemm:<5} chunk {args.chunk} ahead {ahead:<3}: "
                          f"{r['tokens_per_s']:7.0f} tok/s ({r['seconds']:.3f} s)", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
