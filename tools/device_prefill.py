"""Device-side prefill study (one call): GEMM routes per linear shape and chunk size, the cuBLAS
bf16 linear ceiling, prefill tok/s at 2K/8K/32K (optionally 128K) and the per-family breakdown,
27B shapes with seeded random weights. Prints a short table; full JSON to $OUT/prefill.json.

    PYTHONPATH=. python3 tools/device_prefill.py [--tier q4s] [--chunk 4096] [--long] [--attn-prefill v1|v2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from q27py.bench.random_weights import BF16_DENSE_PEAK_TFLOPS, Bench, copy_bandwidth

    ap = argparse.ArgumentParser()
    ap.add_argument("--tier", default="q4s")
    ap.add_argument("--chunk", type=int, nargs="+", default=[4096])
    ap.add_argument("--long", action="store_true", help="also 128K")
    ap.add_argument("--no-routes", action="store_true")
    ap.add_argument("--attn-prefill", default=None,
                    help="prefill attention kernel (default: EngineConfig.attn_prefill, what the engine runs)")
    ap.add_argument("--wgmma", choices=("on", "off"), default=None,
                    help="v2 on the sm_90a wgmma kernel (default: EngineConfig.attn_prefill_wgmma)")
    args = ap.parse_args()
    from q27py.gpu import kernels as K

    if args.wgmma is not None:
        K.ATTN_PREFILL_WGMMA = args.wgmma == "on"

    if args.attn_prefill is None:
        from q27py.config import EngineConfig

        args.attn_prefill = EngineConfig().attn_prefill
    K.ATTN_PREFILL = K.attn_prefill_mode(args.attn_prefill)
    lens = [2048, 8192, 32768] + ([131072] if args.long else [])
    res = {"copy": copy_bandwidth(1 << 30)}
    b = Bench(tier=args.tier, max_context=max(lens) + 64, chunk=args.chunk[0], log=lambda *a: print(*a, flush=True))
    res["device"] = b.rt.describe()
    if not args.no_routes:
        res["routes"] = b.prefill_gemm_routes()
        res["ceiling_8k"] = b.linear_ceiling(res["routes"], 8192)
        print(f"cuBLAS bf16 linear ceiling at 8K: {res['ceiling_8k']['cublas_linear_tok_s']:.0f} tok/s", flush=True)
    res["prefill"] = {}
    from q27py.gpu.forward import FastModel

    for chunk in args.chunk:
        if chunk != b.model.chunk:
            del b.model
            b.model = FastModel(b.weights, max_context=max(lens) + 64, kv_dtype="bf16", chunk=chunk)
            b.stream = b.model.stream
        for n in lens:
            p = b.prefill(n)
            p["fraction_of_bf16_peak"] = p["weight_TFLOPs"] / BF16_DENSE_PEAK_TFLOPS
            res["prefill"][f"{chunk}/{n}"] = p
            print(f"prefill chunk {chunk} T={n}: {p['tokens_per_s']:.0f} tok/s ({p['seconds']:.3f} s)", flush=True)
    res["attn_prefill"] = args.attn_prefill
    res["attn_prefill_wgmma"] = K.ATTN_PREFILL_WGMMA
    res["breakdown"] = []
    for n in lens[1:]:
        bd = b.prefill_breakdown(n)
        res["breakdown"].append(bd)
        print(f"prefill {n} by family (s): " + " ".join(f"{k} {v:.3f}" for k, v in bd["seconds"].items()) +
              "; TFLOP/s " + " ".join(f"{k} {v:.0f}" for k, v in bd["TFLOPs"].items()), flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "prefill.json").write_text(json.dumps(res, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
