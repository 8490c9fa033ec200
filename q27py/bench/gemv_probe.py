"""GEMV micro-benchmark: one matrix shape, rotated over enough copies to defeat the L2, timed
with CUDA graphs; prints achieved GB/s per lane count (and is what `ncu` is pointed at).

    python3 -m q27py.bench.gemv_probe --rows 34816 --cols 5120 --fmt q4 --lanes 1 8 16
"""

from __future__ import annotations

import argparse

from q27py.gpu import kernels as K
from q27py.gpu import layout as L
from q27py.gpu.graphs import capture
from q27py.gpu.runtime import Runtime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=34816)
    ap.add_argument("--cols", type=int, default=5120)
    ap.add_argument("--fmt", choices=["q4", "q8", "bf16"], default="q4")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--once", action="store_true", help="one launch, no timing (for ncu)")
    args = ap.parse_args(argv)
    rt = Runtime.get()
    cp = rt.cp
    fmt = L.FMT_NAMES[args.fmt]
    mats = [K.random_matrix(args.rows, args.cols, fmt, seed=i, scale=0.01) for i in range(args.copies)]
    ws = K.Workspace()
    kpad = mats[0].shape.kpad
    x = cp.zeros((16, kpad), dtype=cp.float32)
    K.fill_uniform(x, 3, -1, 1)
    ys = [cp.zeros((16, args.rows), dtype=cp.float32) for _ in mats]
    plans = [K.GemvPlan([m], [(y, args.rows)], ws) for m, y in zip(mats, ys)]
    stream = cp.cuda.Stream(non_blocking=True)
    nbytes = mats[0].nbytes
    print(f"{args.rows}x{args.cols} {args.fmt}: {nbytes / 1e6:.1f} MB per matrix, splits {plans[0].splits}, "
          f"units {plans[0].launches[0][3]}")
    for n in args.lanes:
        with stream:
            if args.once:
                plans[0].run(x, kpad, n)
                stream.synchronize()
                continue
            g = capture(lambda: [p.run(x, kpad, n) for p in plans], stream)
            for _ in range(3):
                g.launch(stream)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            reps = 10
            for _ in range(reps):
                g.launch(stream)
            e1.record(stream)
            e1.synchronize()
        ms = cp.cuda.get_elapsed_time(e0, e1) / reps / len(plans)
        print(f"  lanes {n:2d}: {ms * 1e3:8.1f} us per matrix  {nbytes / ms / 1e6:7.0f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
