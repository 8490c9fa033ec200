"""The GDN recurrence kernel (cuda/gdn.cu gdn_step_*) alone, at the 27B head shape: one graph of 48
launches (one per GDN layer, each on its own 3.1 MB state, so the 151 MB of states defeat the L2)
per setting -- verify (W lanes, outputs only), decode (1 lane, state written) and commit (n lanes
replayed, state written) -- reported as us per launch. `--ref FILE` also times another build of the
kernel source (e.g. `git show REV:cuda/gdn.cu > FILE`) with the one-warp-per-column launch geometry
of the original kernel, and checks that the two give the same bits.

    git show 077e4c8:cuda/gdn.cu > /tmp/gdn_ref.cu   # the one-warp-per-column kernel
    PYTHONPATH=. python3 tools/gdn_step_bench.py [--ref /tmp/gdn_ref.cu] [--variants 8:4 4:2] [--widths 1 8 16]
    (or: bash tools/device_wave.sh gdnbench)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import cupy as cp
    import numpy as np

    from q27py.bench.random_weights import _time_graph
    from q27py.gpu import kernels as K
    from q27py.gpu.graphs import capture
    from q27py.gpu.runtime import Runtime, compile_options, source_text

    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--ref", default=None, help="another gdn.cu to time beside it (one warp per column)")
    ap.add_argument("--variants", nargs="*", default=[], metavar="LPC:WARPS",
                    help="also time cuda/gdn.cu built with GDN_ST_LPC / GDN_ST_WARPS overridden")
    ap.add_argument("--variant-src", default=None, help="the file the variants compile (default cuda/gdn.cu)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--once", nargs=2, metavar=("MODE", "W"), default=None,
                    help="one eager launch of verify|decode|commit at W lanes, then exit (for ncu)")
    args = ap.parse_args()
    rt = Runtime.get()
    h, hv, dk, dv, nl = 16, 48, 128, 128, args.layers
    width = 2 * h * dk + hv * dv
    rng = cp.random.default_rng(0)
    span = max(args.widths)
    qkvn = rng.standard_normal((nl, span, width), dtype=cp.float32)
    for off in (0, h * dk):  # q, k l2-normalised per head, as gdn_conv leaves them
        x = qkvn[:, :, off : off + h * dk].reshape(nl, span, h, dk)
        x /= cp.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
    gb = cp.concatenate([-cp.exp(rng.standard_normal((nl, span, hv), dtype=cp.float32) * 0.5) * 0.3,
                         1 / (1 + cp.exp(-rng.standard_normal((nl, span, hv), dtype=cp.float32)))], axis=2)
    s0 = rng.standard_normal((nl, hv, dv, dk), dtype=cp.float32) * 0.3
    out = cp.zeros((span, hv * dv), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)

    ref = None
    if args.ref:
        ref = cp.RawModule(code=source_text("gdn", Path(args.ref)),
                           options=compile_options() + ("-DGDN_PF_COLS=4", "-DGDN_PF_WARPS=4")  # an older table's
                           ).get_function("gdn_step_k4")

    # layers > 1: one launch over that many layers (the engine's commit), per-layer strides
    def strides(state, qk, g, layers):
        return (state[0].size, qk[0].size, g[0].size) if layers > 1 else (0, 0, 0)

    def launch_head(state, qk, g, n, emit, write, layers=1):
        ss, qs, gs = strides(state, qk, g, layers)
        K.gdn_step(state, ss, qk, qs, g, gs, out if emit else None, hv * dv, h, hv, dk, dv, n, layers=layers,
                   emit=bool(emit), write_state=bool(write))

    def launch_ref(state, qk, g, n, emit, write, layers=1):
        ss, qs, gs = strides(state, qk, g, layers)
        ref((-(-(hv * dv) // 4), layers), (128,), (state, np.int64(ss), qk, np.int64(qs), g, np.int64(gs), out,
                                            np.int32(hv * dv), np.int32(h), np.int32(hv), np.int32(dk), np.int32(dv),
                                            np.int32(n), np.uint64(0), np.int32(emit), np.int32(write)))

    if args.once:
        mode, w = args.once[0], int(args.once[1])
        fn = launch_ref if args.ref else launch_head
        with stream:
            fn(s0[0], qkvn[0], gb[0], w, int(mode != "commit"), int(mode != "verify"))
            stream.synchronize()
        return 0
    impls = {"head": launch_head}
    if ref is not None:
        impls["ref"] = launch_ref
    for var in args.variants:
        lpc, warps = (int(x) for x in var.split(":"))
        opts = tuple(o for o in compile_options() if not o.startswith(("-DGDN_ST_LPC=", "-DGDN_ST_WARPS=")))
        code = source_text("gdn")
        if args.variant_src:
            code = source_text("gdn", Path(args.variant_src))
        mod = cp.RawModule(code=code, options=opts + (f"-DGDN_ST_LPC={lpc}", f"-DGDN_ST_WARPS={warps}"))
        f = mod.get_function("gdn_step_k4")
        grid = hv * -(-dv // (32 // lpc * warps))

        def launch_var(state, qk, g, n, emit, write, layers=1, f=f, grid=grid, warps=warps):
            ss, qs, gs = strides(state, qk, g, layers)
            f((grid, layers), (32 * warps,), (state, np.int64(ss), qk, np.int64(qs), g, np.int64(gs), out,
                                              np.int32(hv * dv),
                                         np.int32(h), np.int32(hv), np.int32(dk), np.int32(dv), np.int32(n),
                                         np.uint64(0), np.int32(emit), np.int32(write)))
        impls[f"lpc{lpc}w{warps}"] = launch_var
    rows, bits = [], {}
    for name, fn in impls.items():
        state = s0.copy()
        commits = [w for w in args.widths if w > 1]
        for mode, ws in (("verify", args.widths), ("decode", [1]), ("commit", commits), ("commit48", commits)):
            for w in ws:
                emit, write = (1, 0) if mode == "verify" else (1, 1) if mode == "decode" else (0, 1)

                def enqueue():
                    if mode == "commit48":  # one launch over every layer, as FastModel.enqueue_commit
                        fn(state, qkvn, gb, w, emit, write, layers=nl)
                        return
                    for L in range(nl):
                        fn(state[L], qkvn[L], gb[L], w, emit, write)

                with stream:
                    state[...] = s0
                    enqueue()  # eager once: the bits below
                    stream.synchronize()
                    bits[(name, mode, w)] = (out[:w].get().copy() if emit else None, state.get() if write else None)
                    g = capture(enqueue, stream)
                    ms = _time_graph(g, stream, 20)
                us = ms * 1e3 / nl
                rows.append(dict(impl=name, mode=mode, lanes=w, us_per_launch=us))
                print(f"{name:8s} {mode:8s} W={w:2d}: {us:7.2f} us per layer", flush=True)
    same = True
    if len(impls) > 1:
        for key, (o, s) in bits.items():
            if key[0] != "head":
                continue
            for other in impls:
                if other == "head":
                    continue
                o2, s2 = bits[(other,) + key[1:]]
                ok = (o is None or np.array_equal(o, o2)) and (s is None or np.array_equal(s, s2))
                same &= ok
                if not ok:
                    print(f"BITS DIFFER: {other} {key}")
        print(f"head vs {', '.join(x for x in impls if x != 'head')} bitwise: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": rt.describe(), "rows": rows, "bitwise": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
