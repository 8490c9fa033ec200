"""Where a GEMV launch's time goes, per CTA: the unit kernels (cuda/gemv.cu gemv_body; with --impl a8w
cuda/gemv_wg.cu wg_body, the wgmma kernels the 27B decode runs) built with GEMV_TRACE=1 stamp %globaltimer
and clock64 at eight phases of each CTA's life; this replays a graph of quant_act8 + GEMV launches over
L2-defeating copies (as q27py.bench.gemv_probe does) and prints, for the last launch, when the CTAs start /
stream / finish relative to the first CTA's start, and the per-CTA phase durations (clock64 at the SM clock).
wg_body's phases: start, unit decoded, past the PDL wait, first stage landed, streamed, tile reduced,
ticket, end (gemv_body's: start, desc, waited, data0, streamed, barrier, ticket, end).

    PYTHONPATH=. python3 tools/gemv_trace.py --shapes gate_up down gdn_out lm_head --lanes 1 [--impl a8w]
"""

from __future__ import annotations

import argparse

import numpy as np

PHASES = ["start", "desc", "waited", "data0", "streamed", "barrier", "ticket", "end"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["gate_up", "down", "gdn_out", "qkvz", "lm_head"])
    ap.add_argument("--lanes", type=int, nargs="+", default=[1])
    ap.add_argument("--impl", default="a8", help="a8 (cuda/gemv.cu), a8w (q4 launches on cuda/gemv_wg.cu), v1")
    args = ap.parse_args(argv)
    from q27py.gpu import constants as C

    C.GEMV_TRACE = 1  # before the first compile
    from q27py.bench.gemv_probe import SHAPES_27B, L2_DEFEAT_BYTES, MAX_COPIES
    from q27py.bench.random_weights import _time_graph
    from q27py.gpu import kernels as K
    from q27py.gpu import layout as L
    from q27py.gpu.graphs import capture
    from q27py.gpu.runtime import Runtime

    rt = Runtime.get()
    cp = rt.cp
    shapes = dict(SHAPES_27B)
    shapes["qkvz"] = ([(16384, 5120, "q4")], 48)
    shapes["ab"] = ([(96, 5120, "bf16")], 48)
    clock_ghz = cp.cuda.Device().attributes.get("ClockRate", 1980000) / 1e6  # kHz
    print(f"{rt.name}: SM clock attribute {clock_ghz:.2f} GHz; times in us from the launch's first CTA start")
    for name in args.shapes:
        (rows, cols, fmt_name), = shapes[name][0][:1]
        fmt = L.FMT_NAMES[fmt_name]
        one = L.matrix_shape(rows, cols, fmt)
        copies = int(min(MAX_COPIES, max(2, -(-L2_DEFEAT_BYTES // (one.code_bytes + one.scale_bytes)))))
        mats = [K.random_matrix(rows, cols, fmt, seed=7 + i, scale=0.01 if fmt != L.FMT_BF16 else 0.05) for i in range(copies)]
        x = cp.zeros((16, one.kpad), dtype=cp.float32)
        K.fill_uniform(x, 3, -1, 1)
        y = cp.zeros((16, rows), dtype=cp.float32)
        ws = K.Workspace()
        wg = args.impl == "a8w"
        plans = [K.GemvPlan([m], [(y, rows)], ws, impl="a8" if wg else args.impl, wgmma="all" if wg else "off")
                 for m in mats]
        grid = plans[0].launches[0][3]
        buf = rt.module("gemv_wg" if wg and fmt == L.FMT_Q4 else "gemv").get_global("gemv_trace")
        tr = cp.ndarray((2, 16384, 8), dtype=cp.uint64, memptr=buf)
        stream = cp.cuda.Stream(non_blocking=True)
        for n in args.lanes:
            with stream:
                g = capture(lambda: [p.run(x, one.kpad, n) for p in plans], stream)
                us = _time_graph(g, stream, 5) * 1e3 / len(plans)
                tr.fill(0)
                g.launch(stream)
                stream.synchronize()
            a = tr.get()[:, :grid].astype(np.int64)
            gt, ck = a[0], a[1]
            split = plans[0].splits[0]
            if split == 1:  # no ticket phase: stamp 6 is never written
                gt[:, 6], ck[:, 6] = gt[:, 5], ck[:, 5]
            t0 = gt[:, 0].min()
            rel = (gt - t0) / 1e3
            last = gt[:, 7].max()
            dur = np.diff(ck, axis=1) / (clock_ghz * 1e3)  # us per phase, per CTA
            print(f"\n{name} {rows}x{cols} {fmt_name}, {n} lane(s): {grid} CTAs, splits {split}, "
                  f"{us:.2f} us per launch in the graph ({(one.code_bytes + one.scale_bytes) / us / 1e3:.0f} GB/s); "
                  f"first start -> last end {(last - t0) / 1e3:.2f} us")
            print("  CTA start (us): p0 %.2f p50 %.2f p90 %.2f max %.2f;  end: p0 %.2f p50 %.2f max %.2f" % (
                *np.percentile(rel[:, 0], [0, 50, 90, 100]), *np.percentile(rel[:, 7], [0, 50, 100])))
            cols_ = ["desc", "issue+wait", "first data", "stream", "barrier", "reduce+ticket", "epilogue"]
            if wg and fmt == L.FMT_Q4:
                cols_ = ["decode", "prologue+wait", "first stage", "stream", "tile", "reduce+ticket", "epilogue"]
            if split == 1:
                cols_[5] = "-"
            print("  per-CTA phase us (p10 / p50 / p90): " + "; ".join(
                f"{c} {np.percentile(dur[:, i], 10):.2f}/{np.percentile(dur[:, i], 50):.2f}/{np.percentile(dur[:, i], 90):.2f}"
                for i, c in enumerate(cols_) if c != "-"))
        del plans, mats
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
