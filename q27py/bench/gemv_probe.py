"""GEMV micro-benchmark: matrix shapes rotated over enough distinct copies to defeat the L2, timed
with CUDA graphs; achieved GB/s per lane count against a streaming-read probe measured in the same
run (cuda/probe.cu), for any GEMV implementation (cuda/gemv.cu v1 / a8, cuda/gemv2.cu v2; "a8w": a8
with its q4 launches on cuda/gemv_wg.cu).

    python3 -m q27py.bench.gemv_probe --rows 34816 --cols 5120 --fmt q4 --lanes 1 8 16
    python3 -m q27py.bench.gemv_probe --shapes 27b --impl v1 v2 --lanes 1 2 4 8 9 12 16
    python3 -m q27py.bench.gemv_probe --shapes 27b --impl a8 a8w --lanes 16 17 24 32

Lanes go up to GWG_MAX_LANES (32), always on the GEMV (never the prefill GEMM, which 32 tokens would
take): past 16, a8w runs each q4 launch as one gemv8w_q4_n32 launch (one weight sweep), the others as
two 16-lane blocks.

--shapes 27b runs the Qwen3.6-27B launches of one decode step (q4s tier, as q27py/gpu/weights.py
random_weights builds them; the GDN and attention input projections are one launch of two
matrices, as in q27py/gpu/forward.py) and adds a "GEMV family" row: the step's GEMV time at each
width, weighted by how often each launch runs per forward. `--once` (one launch, no timing) is
what `ncu` is pointed at.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from q27py.bench.random_weights import _time_graph, read_probe_ms
from q27py.gpu import kernels as K
from q27py.gpu import layout as L
from q27py.gpu.graphs import capture
from q27py.gpu.runtime import Runtime

L2_DEFEAT_BYTES = 256 << 20  # rotate copies until one pass streams > 4x the H200's 60 MB L2
MAX_COPIES = 64

# name -> (matrices [(rows, cols, fmt)], launches per forward of the 27B: 48 GDN + 16 attention layers)
SHAPES_27B = {
    "gate_up": ([(34816, 5120, "q4")], 64),
    "down": ([(5120, 17408, "q4")], 64),
    "gdn_in": ([(16384, 5120, "q4"), (96, 5120, "bf16")], 48),  # qkvz + ab (decay / beta gates)
    "gdn_out": ([(5120, 6144, "q4")], 48),
    "attn_in": ([(12288, 5120, "q4"), (2048, 5120, "q8")], 16),  # q (+gate) + k/v
    "attn_o": ([(5120, 6144, "q4")], 16),
    "lm_head": ([(248320, 5120, "q4")], 1),
    "mtp_gate_up_q8": ([(34816, 5120, "q8")], 0),  # MTP layer (q8), not in the forward's bytes
    "mtp_down_q8": ([(5120, 17408, "q8")], 0),
}


def read_probe(nbytes: int = 2 << 30) -> float:
    """Streaming-read ceiling in GB/s (the probe random_weights.copy_bandwidth reports)."""
    cp = Runtime.get().cp
    src = cp.empty(nbytes // 4, dtype=cp.float32)
    K.fill_uniform(src, 1, -1.0, 1.0)
    sink = cp.zeros(1, dtype=cp.uint32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        ms = read_probe_ms(src, sink, stream, 20)
    del src
    return nbytes / ms / 1e6


def measure(mats_spec, impls, lanes, copies: int | None = None, partition=None, once: bool = False) -> dict:
    """{impl: {lanes: us per launch}} for one launch shape (1..4 matrices sharing x)."""
    rt = Runtime.get()
    cp = rt.cp
    fmts = [L.FMT_NAMES[f] for _, _, f in mats_spec]
    one = sum(L.matrix_shape(r, c, f).code_bytes + L.matrix_shape(r, c, f).scale_bytes
              for (r, c, _), f in zip(mats_spec, fmts))
    if copies is None:
        copies = int(min(MAX_COPIES, max(2, -(-L2_DEFEAT_BYTES // one))))
    sets = []
    for i in range(copies):
        ms = [K.random_matrix(r, c, f, seed=1000 * i + j, scale=0.01 if f != L.FMT_BF16 else 0.05)
              for j, ((r, c, _), f) in enumerate(zip(mats_spec, fmts))]
        sets.append(ms)
    kpad = sets[0][0].shape.kpad
    rows = max(K.GEMV_MAX_LANES, *lanes)  # every lane measured has its own x and y rows
    x = cp.zeros((rows, kpad), dtype=cp.float32)
    K.fill_uniform(x, 3, -1, 1)
    ys = [cp.zeros((rows, r), dtype=cp.float32) for r, _, _ in mats_spec]
    ws = K.Workspace()
    stream = cp.cuda.Stream(non_blocking=True)
    out = {"bytes": one, "copies": copies}
    for impl in impls:
        # "a8w": the a8 kernels with their q4 launches on cuda/gemv_wg.cu (wgmma, sm_90a), every width
        plans = [K.GemvPlan(ms, [(y, y.shape[1]) for y in ys], ws, impl="a8" if impl == "a8w" else impl,
                            partition=partition, wgmma="all" if impl == "a8w" else "off") for ms in sets]
        out[impl] = {"partition": [list(p) for p in zip(plans[0].rgb, plans[0].splits)],
                     "ctas": [u for _, _, _, u in plans[0].launches], "us": {}}
        for n in lanes:
            with stream:
                if once:
                    plans[0].run(x, kpad, n, allow_gemm=False)
                    stream.synchronize()
                    continue
                g = capture(lambda: [p.run(x, kpad, n, allow_gemm=False) for p in plans], stream)
                ms_ = _time_graph(g, stream, 12)
            out[impl]["us"][n] = ms_ * 1e3 / len(plans)
        del plans
    del sets
    cp.get_default_memory_pool().free_all_blocks()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=34816)
    ap.add_argument("--cols", type=int, default=5120)
    ap.add_argument("--fmt", choices=["q4", "q8", "bf16"], default="q4")
    ap.add_argument("--shapes", nargs="*", default=None,
                    help="'27b' (every 27B launch) or names from it; default: the one --rows/--cols/--fmt matrix")
    ap.add_argument("--impl", nargs="+", choices=[*K.GEMV_IMPLS, "a8w"], default=None,
                    help="default: the configured one; a8w: a8 with its q4 launches on the wgmma kernel (sm_90a)")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 8, 16],
                    help=f"lane counts, 1..{K.GWG_MAX_LANES} (past 16: a8w's q4 launches on gemv8w_q4_n32)")
    ap.add_argument("--copies", type=int, default=None, help="distinct copies rotated (default: enough to defeat L2)")
    ap.add_argument("--partition", type=int, nargs=2, metavar=("RGB", "SPLITS"), default=None,
                    help="v2: force row groups per CTA and splits (sweeps)")
    ap.add_argument("--splits", type=int, nargs="+", default=None,
                    help="v1 / a8: one row per forced K-split count for each shape (sweeps; the family row then "
                         "takes each shape's best)")
    ap.add_argument("--set", nargs="+", default=[], metavar="NAME=VALUE",
                    help="override constants-table entries (q27py/gpu/constants.py) before the kernels compile, "
                         "e.g. G2_CTAS_NT2=2 PIPE2_Q4=4: A/B of pipeline depth and occupancy in one run")
    ap.add_argument("--once", action="store_true", help="one launch, no timing (for ncu)")
    ap.add_argument("--json", default=None, help="also write the full numbers here")
    args = ap.parse_args(argv)
    if not all(1 <= n <= K.GWG_MAX_LANES for n in args.lanes):
        ap.error(f"--lanes: 1 .. {K.GWG_MAX_LANES}")
    overrides = _apply_overrides(args.set)
    impls = args.impl or [K.gemv_impl()]
    if args.shapes is None:
        shapes = {f"{args.rows}x{args.cols} {args.fmt}": ([(args.rows, args.cols, args.fmt)], 0)}
    elif args.shapes == ["27b"] or args.shapes == []:
        shapes = SHAPES_27B
    else:
        shapes = {n: SHAPES_27B[n] for n in args.shapes}
    rt = Runtime.get()
    probe = None if args.once else read_probe()
    results = {"device": rt.describe(), "read_probe_GBps": probe, "lanes": args.lanes, "overrides": overrides,
               "shapes": {}}
    if probe:
        print(f"{rt.name}: streaming-read probe {probe:.0f} GB/s; GB/s per lane count (% of the probe at 1/8/16 lanes)"
              + (f"; constants {' '.join(args.set)}" if args.set else ""))
    w = max(max(len(n) for n in shapes) + 2, len("GEMV family/forward"))
    print(f"{'launch':{w}s} {'MB':>6s} {'impl':4s} {'rgb x splits':12s} " + " ".join(f"{n:>5d}" for n in args.lanes)
          + "   %@1  %@8 %@16  W8/1 W16/1")
    fam = {impl: {n: 0.0 for n in args.lanes} for impl in impls}
    fam_bytes = 0
    sweep = [None] if not args.splits else [(1, s) for s in args.splits]
    for name, (spec, per_forward) in shapes.items():
        best = {}
        for forced in sweep:
            part_arg = forced or (tuple(args.partition) if args.partition else None)
            r = measure(spec, impls, args.lanes, args.copies, part_arg, args.once)
            results["shapes"][name if forced is None else f"{name} s={forced[1]}"] = r
            if args.once:
                continue
            for impl in impls:
                us = r[impl]["us"]
                gbs = {n: r["bytes"] / (us[n] * 1e3) for n in args.lanes}
                for n in args.lanes:
                    best.setdefault(impl, {})[n] = min(best.get(impl, {}).get(n, float("inf")), us[n])
                part = "/".join(f"{a}x{b}" for a, b in r[impl]["partition"]) if impl == "v2" else \
                    "s=" + "/".join(str(b) for _, b in r[impl]["partition"])
                print(f"{name:{w}s} {r['bytes'] / 1e6:6.1f} {impl:4s} {part:12s} " + " ".join(f"{gbs[n]:5.0f}" for n in args.lanes)
                      + "  " + _fractions(gbs, us, probe, args.lanes))
        if args.once:
            continue
        fam_bytes += per_forward * r["bytes"]
        for impl in impls:
            for n in args.lanes:
                fam[impl][n] += per_forward * best[impl][n]
    if fam_bytes and not args.once:
        for impl in impls:
            us = fam[impl]
            gbs = {n: fam_bytes / (us[n] * 1e3) for n in args.lanes}
            print(f"{'GEMV family/forward':{w}s} {fam_bytes / 1e6:6.0f} {impl:4s} {'':12s} "
                  + " ".join(f"{gbs[n]:5.0f}" for n in args.lanes) + "  " + _fractions(gbs, us, probe, args.lanes)
                  + f"  ({us[args.lanes[0]] / 1e3:.2f} ms at {args.lanes[0]} lane)")
            results.setdefault("family_us", {})[impl] = us
        results["family_bytes"] = fam_bytes
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


def _apply_overrides(items: list[str]) -> dict[str, int]:
    """NAME=VALUE pairs onto the constants table (the compile options read it at first compile)."""
    from q27py.gpu import constants as C

    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in C.table():
            raise SystemExit(f"--set: {name!r} is not in the constants table")
        setattr(C, name, int(value))
        out[name] = int(value)
    return out


def _fractions(gbs: dict, us: dict, probe: float | None, lanes) -> str:
    def pct(n):
        return f"{100 * gbs[n] / probe:4.0f}" if (probe and n in gbs) else "   -"

    def ratio(n):
        return f"{us[n] / us[lanes[0]]:5.2f}" if n in us else "    -"

    return f"{pct(1)} {pct(8)} {pct(16)} {ratio(8)} {ratio(16)}"


if __name__ == "__main__":
    raise SystemExit(main())
