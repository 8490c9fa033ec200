"""Device-side GDN prefill study: the sequential kernel (gdn_prefill) against the chunked tensor-core
kernel (gdn_prefill_chunked) and the three-kernel pipeline (gdn_prefill_chunked2, both state-pass
variants where they fit: s2 double-buffered, s1 single stage) for one 27B GDN layer (H 16, HV 48,
dk = dv = 128) at T = 2K / 8K / 32K: milliseconds per layer (CUDA events, median of --reps after a
warm-up), chunked2's split over its kernels (pre-pass / state / output), the run fed in 4096-lane
pieces (bitwise equal to one run?), and the relative L2 gap of outputs and final state against the
sequential kernel. Prints a table; JSON to $OUT/gdn.json.

    PYTHONPATH=. python3 tools/device_gdn.py [--lens 2048 8192 32768] [--reps 5] [--piece 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import cupy as cp
    import numpy as np

    from q27py.gpu import kernels as K
    from q27py.gpu.runtime import Runtime

    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--piece", type=int, default=4096, help="also time the run fed in pieces of this many lanes "
                    "(the engine's gpu_prefill_chunk); 0 = off")
    args = ap.parse_args()
    rt = Runtime.get()
    h, hv, dk, dv = 16, 48, 128, 128
    width = 2 * h * dk + hv * dv
    res = {"device": rt.describe(), "shape": dict(h=h, hv=hv, dk=dk, dv=dv), "chunk": K.gdn_chunk_size(dk, dv),
           "rows": []}
    rng = cp.random.default_rng(0)

    def timed(fn) -> float:
        fn()
        cp.cuda.Device().synchronize()
        ms = []
        for _ in range(args.reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms.append(cp.cuda.get_elapsed_time(a, b))
        return float(np.median(ms))

    for t in args.lens:
        qkvn = rng.standard_normal((t, width), dtype=cp.float32)
        for off in (0, h * dk):  # q, k rows l2-normalised per head (q also scaled), as gdn_conv leaves them
            x = qkvn[:, off : off + h * dk].reshape(t, h, dk)
            x /= cp.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)
            if off == 0:
                x *= dk ** -0.5
        gb = cp.empty((t, 2 * hv), cp.float32)
        gb[:, :hv] = -cp.exp(rng.standard_normal((t, hv), dtype=cp.float32) * 0.5) * 0.3
        gb[:, hv:] = 1 / (1 + cp.exp(-rng.standard_normal((t, hv), dtype=cp.float32)))
        s0 = rng.standard_normal((hv, dv, dk), dtype=cp.float32) * 0.3
        outs = {}
        row = {"T": t}
        scratch = cp.empty(K.gdn2_scratch_floats(K.gdn2_max_chunks(t), hv, dk, dv), cp.float32)
        routes = [("sequential", lambda s, o, a, b, n, p: K.gdn_prefill(s, a, b, o, hv * dv, h, hv, dk, dv, n)),
                  ("chunked", lambda s, o, a, b, n, p: K.gdn_prefill_chunked(s, a, b, o, hv * dv, h, hv, dk, dv,
                                                                            n, pos0=p))]
        for st in [x for x in (2, 1) if x <= K.gdn2_stages(dk, dv)]:
            routes.append((f"chunked2_s{st}", lambda s, o, a, b, n, p, st=st: K.gdn_prefill_chunked2(
                s, a, b, o, hv * dv, h, hv, dk, dv, n, pos0=p, scratch=scratch, stages=st)))
        for name, fn in routes:
            state, out = s0.copy(), cp.full((t, hv * dv), cp.nan, cp.float32)

            def whole():
                state[...] = s0
                fn(state, out, qkvn, gb, t, 0)

            row[f"{name}_ms"] = timed(whole)
            whole()
            cp.cuda.Device().synchronize()
            outs[name] = (out.get(), state.get())
            if args.piece and t > args.piece:
                def pieces():
                    state[...] = s0
                    for p0 in range(0, t, args.piece):
                        n = min(args.piece, t - p0)
                        fn(state, out[p0:], qkvn[p0:], gb[p0:], n, p0)

                row[f"{name}_pieces_ms"] = timed(pieces)
                pieces()
                cp.cuda.Device().synchronize()
                row[f"{name}_pieces_bitwise_whole"] = bool(np.array_equal(out.get(), outs[name][0])
                                                           and np.array_equal(state.get(), outs[name][1]))
        # chunked2's split over its three kernels (events around the launches, median of reps)
        split = {"prep": [], "state": [], "out": []}
        for _ in range(args.reps):
            ev = [cp.cuda.Event() for _ in range(4)]
            state = s0.copy()
            K.gdn_prefill_chunked2(state, qkvn, gb, out, hv * dv, h, hv, dk, dv, t, scratch=scratch, events=ev)
            ev[3].synchronize()
            for i, k in enumerate(split):
                split[k].append(cp.cuda.get_elapsed_time(ev[i], ev[i + 1]))
        row["chunked2_split_ms"] = {k: float(np.median(v)) for k, v in split.items()}
        rel = lambda a, b: float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))  # noqa: E731
        for name in [n for n, _ in routes if n != "sequential"]:
            row[f"{name}_rel_out"] = rel(outs[name][0], outs["sequential"][0])
            row[f"{name}_rel_state"] = rel(outs[name][1], outs["sequential"][1])
            row[f"{name}_max_rel_state"] = float(np.abs(outs[name][1] - outs["sequential"][1]).max()
                                                 / np.abs(outs["sequential"][1]).max())
            row[f"{name}_nan_out"] = bool(np.isnan(outs[name][0]).any())
            row[f"{name}_speedup"] = row["sequential_ms"] / row[f"{name}_ms"]
            row[f"{name}_us_per_token"] = 1e3 * row[f"{name}_ms"] / t
            print(f"T={t:6d}  {name:12s} {row[f'{name}_ms']:8.3f} ms (sequential {row['sequential_ms']:8.3f})  "
                  f"x{row[f'{name}_speedup']:.1f}  rel out {row[f'{name}_rel_out']:.2e} "
                  f"state {row[f'{name}_rel_state']:.2e}  "
                  + (f"pieces {row[f'{name}_pieces_ms']:.3f} ms bitwise={row[f'{name}_pieces_bitwise_whole']}"
                     if f"{name}_pieces_ms" in row else ""), flush=True)
        parts = "  ".join(f"{k} {v:.3f}" for k, v in row["chunked2_split_ms"].items())
        total = sum(row["chunked2_split_ms"].values())
        print(f"T={t:6d}  chunked2 split (ms per layer): {parts}  = {total:.3f}  "
              f"(sequential {row['sequential_ms']:.3f}, x{row['sequential_ms'] / total:.2f})", flush=True)
        if "chunked2_s1" in outs and "chunked2_s2" in outs:
            row["chunked2_stages_bitwise"] = bool(np.array_equal(outs["chunked2_s1"][0], outs["chunked2_s2"][0])
                                                  and np.array_equal(outs["chunked2_s1"][1], outs["chunked2_s2"][1]))
        res["rows"].append(row)
        del qkvn, gb, scratch
    out_dir = Path(os.environ.get("OUT", "/tmp/q27-device"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gdn.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
