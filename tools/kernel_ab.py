"""A/B of a kernel module's source against an earlier copy on the device (one call): the GDN chunked2
pipeline (cuda/gdn_chunk2.cu) at the 27B head shape and a small one, both sources on the same inputs --
outputs and final states compared BITWISE -- and each of its three kernels timed (CUDA events, median
of --reps) under both. For changes meant to keep the bits (e.g. splitting an operand once per CTA).

    git show REV:cuda/gdn_chunk2.cu > .ab/gdn_chunk2.cu     # here; carry .ab
    PYTHONPATH=. python3 tools/kernel_ab.py --old .ab/gdn_chunk2.cu [--tokens 4096] [--reps 5]

--state-ab: the state pass's variants of this source against each other in one process (no --old needed):
4 warps (state_body) and 8 warps (state8_body, pairs of warps) x presplit (W and K / K alone / none), the
card's stage count, the same inputs, run round-robin (median of --reps per variant); out, final state and
the whole scratch (S_c and V_new included) compared BITWISE on the device against the 4-warp default;
a table of ms per layer (prep / state / out) and the state pass against the 4-warp default:

    PYTHONPATH=. python3 tools/kernel_ab.py --state-ab --tokens 8192 [--reps 7]

--tf32-ab: the one-TF32-product classes against today's fp32-grade passes in one process: off, "tf32 state"
(kernels.GDN2_STATE_TF32: gdn2_prep1 / gdn2_state1; "state-k": its K rounded once a chunk, gdn2_state1_*_s2k_w8),
and with "tf32 out" on top (GDN2_OUT_TF32), round-robin;
ms per layer of each pass and the relative L2 of out and the final state against the off run:

    PYTHONPATH=. python3 tools/kernel_ab.py --tf32-ab --tokens 8192 [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@contextmanager
def module_source(rt, name: str, path: Path):
    """Inside: module `name` is compiled from `path` (its cuda/*.cuh headers spliced, the same options)."""
    from q27py.gpu.runtime import compile_options, source_text

    text = source_text(name, path)
    saved_mod = rt._modules.get(name)
    saved_fns = {k: v for k, v in rt._functions.items() if k[0] == name}
    # the shared-memory opt-in is set once per function object: the swapped-in functions need their own
    saved_smem = {k: v for k, v in rt._shared_set.items() if k[0] == name}
    mod = rt.cp.RawModule(code=text, options=compile_options())
    mod.compile()
    rt._modules[name] = mod
    for k in saved_fns:
        del rt._functions[k]
    for k in saved_smem:
        del rt._shared_set[k]
    try:
        yield
    finally:
        for d, saved in ((rt._functions, saved_fns), (rt._shared_set, saved_smem)):
            for k in [k for k in d if k[0] == name]:
                del d[k]
            d.update(saved)
        if saved_mod is None:
            rt._modules.pop(name, None)
        else:
            rt._modules[name] = saved_mod


def gdn_inputs(rng, t: int, h: int, hv: int, dk: int, dv: int) -> dict:
    q = rng.standard_normal((t, h, dk))
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * dk ** 0.5
    k = rng.standard_normal((t, h, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((t, hv, dv))
    g = -np.exp(rng.standard_normal((t, hv)) * 0.5) * 0.3
    beta = 1 / (1 + np.exp(-rng.standard_normal((t, hv))))
    s0 = rng.standard_normal((hv, dv, dk)) * 0.3  # device layout, K-last
    qkvn = np.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=1).astype(np.float32)
    return {"qkvn": qkvn, "gb": np.concatenate([g, beta], axis=1).astype(np.float32), "s0": s0.astype(np.float32)}


def run_gdn(cp, K, d: dict, h: int, hv: int, dk: int, dv: int, t: int, pos0: int, reps: int, presplit=None,
            warps=None):
    """(out, state, median ms of prep / state / out) of the chunked2 pipeline on these inputs (presplit, warps:
    the state pass's variant, None = the card's default)."""
    qkvn, gb = cp.asarray(d["qkvn"]), cp.asarray(d["gb"])
    scratch = cp.empty(K.gdn2_scratch_floats(K.gdn2_nchunks(t, pos0), hv, dk, dv), dtype=cp.float32)
    times = []
    for r in range(reps + 1):
        state = cp.asarray(d["s0"])
        out = cp.full((t, hv * dv), np.nan, dtype=cp.float32)
        ev = [cp.cuda.Event() for _ in range(4)]
        K.gdn_prefill_chunked2(state, qkvn, gb, out, hv * dv, h, hv, dk, dv, t, pos0=pos0, scratch=scratch,
                               presplit=presplit, warps=warps, events=ev)
        ev[3].synchronize()
        if r:  # the first run compiles and warms
            times.append([cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) for i in range(3)])
    return out.get(), state.get(), np.median(np.array(times), axis=0).tolist()


def state_variants(K, dk: int, dv: int) -> list[tuple[int, bool | str, int]]:
    """The state pass's variants at the card's default stage count: (stages, presplit, warps), the 4-warp
    default first (the baseline)."""
    base = K.gdn2_state_variant(dk, dv, 4)
    out = [base]
    for w in (4, 8):
        for p in (True, "k", False):
            v = (base[0], p, w)
            if v not in out and K.gdn2_state_kernel_exists(*v) and K.gdn2_fits(dk, dv, v[0], p):
                out.append(v)
    return out


def state_ab(cp, K, cases, reps: int) -> tuple[list, bool]:
    """Every state variant on each case, round-robin over --reps (+ one warm-up); bitwise against the first."""
    res, ok = [], True
    for name, s, t, pos0 in cases:
        h, hv, dk, dv = s["h"], s["hv"], s["dk"], s["dv"]
        d = gdn_inputs(np.random.default_rng(t + pos0), t, **s)
        qkvn, gb = cp.asarray(d["qkvn"]), cp.asarray(d["gb"])
        n = K.gdn2_scratch_floats(K.gdn2_nchunks(t, pos0), hv, dk, dv)
        variants = state_variants(K, dk, dv)
        times = {v: [] for v in variants}
        ref, same = None, {}
        scratch = cp.full(n, np.nan, dtype=cp.float32)
        for r in range(reps + 1):
            for v in variants:
                state = cp.asarray(d["s0"])
                out = cp.full((t, hv * dv), np.nan, dtype=cp.float32)
                if r == 0:
                    scratch.fill(np.nan)
                ev = [cp.cuda.Event() for _ in range(4)]
                K.gdn_prefill_chunked2(state, qkvn, gb, out, hv * dv, h, hv, dk, dv, t, pos0=pos0, scratch=scratch,
                                       stages=v[0], presplit=v[1], warps=v[2], events=ev)
                ev[3].synchronize()
                if r == 0:  # the first round compiles and warms; its results are the ones compared
                    got = [x.view(cp.uint32).copy() for x in (out, state, scratch)]
                    if ref is None:
                        ref = got
                    same[v] = all(bool(cp.array_equal(a, b)) for a, b in zip(got, ref))
                    del got
                else:
                    times[v].append([cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) for i in range(3)])
        base = float(np.median([x[1] for x in times[variants[0]]]))
        for v in variants:
            ms = np.median(np.array(times[v]), axis=0).tolist()
            ok &= same[v]
            res.append({"case": name, "tokens": t, "pos0": pos0, "stages": v[0], "presplit": v[1], "warps": v[2],
                        "ms": ms, "state_vs_base": ms[1] / base, "bitwise": same[v]})
        del ref, scratch
    return res, ok


# (label, GDN2_STATE_TF32, GDN2_OUT_TF32, the state pass's (stages, presplit) or None for the default)
TF32_CASES = (("off", False, False, None), ("state", True, False, None), ("state-k", True, False, (2, "k")),
              ("state+out", True, True, None))


def tf32_ab(cp, K, cases, reps: int) -> list:
    """Each (GDN2_STATE_TF32, GDN2_OUT_TF32) setting of TF32_CASES on each case, round-robin over --reps (+ one
    warm-up whose results are compared: relative L2 of out and the final state against the off run)."""
    res = []
    saved = (K.GDN2_STATE_TF32, K.GDN2_OUT_TF32)
    try:
        for name, s, t, pos0 in cases:
            h, hv, dk, dv = s["h"], s["hv"], s["dk"], s["dv"]
            d = gdn_inputs(np.random.default_rng(t + pos0), t, **s)
            qkvn, gb = cp.asarray(d["qkvn"]), cp.asarray(d["gb"])
            scratch = cp.empty(K.gdn2_scratch_floats(K.gdn2_nchunks(t, pos0), hv, dk, dv), dtype=cp.float32)
            times = {c[0]: [] for c in TF32_CASES}
            got = {}
            for r in range(reps + 1):
                for label, st_on, out_on, var in TF32_CASES:
                    K.GDN2_STATE_TF32, K.GDN2_OUT_TF32 = st_on, out_on
                    stages, presplit = var if var and K.gdn2_fits(dk, dv, *var) else (None, None)
                    state = cp.asarray(d["s0"])
                    out = cp.full((t, hv * dv), np.nan, dtype=cp.float32)
                    ev = [cp.cuda.Event() for _ in range(4)]
                    K.gdn_prefill_chunked2(state, qkvn, gb, out, hv * dv, h, hv, dk, dv, t, pos0=pos0,
                                           scratch=scratch, stages=stages, presplit=presplit, events=ev)
                    ev[3].synchronize()
                    if r == 0:
                        got[label] = (out.get().astype(np.float64), state.get().astype(np.float64))
                    else:
                        times[label].append([cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) for i in range(3)])
            o0, s0 = got["off"]
            for label, *_ in TF32_CASES:
                o, st = got[label]
                res.append({"case": name, "tokens": t, "pos0": pos0, "class": label,
                            "ms": np.median(np.array(times[label]), axis=0).tolist(),
                            "out_rel": float(np.linalg.norm(o - o0) / np.linalg.norm(o0)),
                            "state_rel": float(np.linalg.norm(st - s0) / np.linalg.norm(s0)),
                            "nan": bool(np.isnan(o).any() or np.isnan(st).any())})
            del scratch
    finally:
        K.GDN2_STATE_TF32, K.GDN2_OUT_TF32 = saved
    return res


def print_tf32_table(res: list) -> None:
    print("| case | class | prep ms | **state ms** | out ms | sum | x off | out rel L2 | state rel L2 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = {}
    for r in res:
        ms = r["ms"]
        key = (r["case"], r["tokens"], r["pos0"])
        base.setdefault(key, sum(ms))
        print(f"| {r['case']} T={r['tokens']} pos0={r['pos0']} | {r['class']} | {ms[0]:.3f} | **{ms[1]:.3f}** | "
              f"{ms[2]:.3f} | {sum(ms):.3f} | {sum(ms) / base[key]:.3f} | {r['out_rel']:.2e} | {r['state_rel']:.2e}"
              f"{' NaN' if r['nan'] else ''} |", flush=True)


def print_state_table(res: list) -> None:
    print("| case | warps | stages | presplit | prep ms | **state ms** | state / 4-warp default | out ms | bits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in res:
        p = {True: "W+K", "k": "K", False: "-"}[r["presplit"]]
        ms = r["ms"]
        print(f"| {r['case']} T={r['tokens']} pos0={r['pos0']} | {r['warps']} | {r['stages']} | {p} | {ms[0]:.3f} | "
              f"**{ms[1]:.3f}** | {r['state_vs_base']:.3f} | {ms[2]:.3f} | {'SAME' if r['bitwise'] else 'DIFFERENT'} |",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, help="the earlier cuda/gdn_chunk2.cu")
    ap.add_argument("--state-ab", action="store_true", help="the state pass's variants of this source, one process")
    ap.add_argument("--tf32-ab", action="store_true", help="the one-TF32-product classes against off, one process")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not args.old and not args.state_ab and not args.tf32_ab:
        ap.error("give --old FILE and / or --state-ab / --tf32-ab")
    import cupy as cp

    from q27py.gpu import kernels as K
    from q27py.gpu.runtime import Runtime

    rt = Runtime.get()
    cases = [("27b", dict(h=16, hv=48, dk=128, dv=128), args.tokens, 0),
             ("27b-ragged", dict(h=16, hv=48, dk=128, dv=128), 1000, 37),
             ("small", dict(h=2, hv=6, dk=64, dv=64), 1000, 5)]
    res, ok = [], True
    if args.tf32_ab:
        tres = tf32_ab(cp, K, cases, args.reps)
        print_tf32_table(tres)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "kernel_ab_tf32.json").write_text(json.dumps(tres, indent=1))
        ok = not any(r["nan"] for r in tres)
        if not args.old and not args.state_ab:
            return 0 if ok else 1
    # the bitwise A/Bs below compare the fp32-grade passes' variants (the one-TF32-product classes, on by default,
    # have their own entries and --tf32-ab)
    K.GDN2_STATE_TF32 = K.GDN2_OUT_TF32 = False
    if args.state_ab:
        sres, ok = state_ab(cp, K, cases, args.reps)
        print_state_table(sres)
        out = os.environ.get("OUT")
        if out:
            Path(out, "kernel_ab_state.json").write_text(json.dumps(sres, indent=1))
        if not args.old:
            return 0 if ok else 1
    for name, s, t, pos0 in cases:
        d = gdn_inputs(np.random.default_rng(t + pos0), t, **s)
        new = run_gdn(cp, K, d, s["h"], s["hv"], s["dk"], s["dv"], t, pos0, args.reps)
        plain = run_gdn(cp, K, d, s["h"], s["hv"], s["dk"], s["dv"], t, pos0, args.reps, presplit=False)
        with module_source(rt, "gdn_chunk2", args.old):  # an old source may predate the presplit / 8-warp variants
            old = run_gdn(cp, K, d, s["h"], s["hv"], s["dk"], s["dv"], t, pos0, args.reps, presplit=False, warps=4)
        same = bool(all(np.array_equal(x[0].view(np.uint32), old[0].view(np.uint32))
                        and np.array_equal(x[1].view(np.uint32), old[1].view(np.uint32)) for x in (new, plain)))
        ok &= same and not np.isnan(new[0]).any()
        variant = K.gdn2_state_variant(s["dk"], s["dv"])
        row = {"case": name, "tokens": t, "pos0": pos0, "bitwise": same, "variant": variant, "ms_new": new[2],
               "ms_new_plain_state": plain[2], "ms_old": old[2]}
        res.append(row)
        ms = lambda r: " / ".join(f"{x:.3f}" for x in r[2])  # noqa: E731
        print(f"gdn_chunk2 {name} T={t} pos0={pos0}: bitwise {'SAME' if same else 'DIFFERENT'}; ms prep / state / out "
              f"new {ms(new)} (state variant {variant})  new, plain state {ms(plain)}  old {ms(old)}", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "kernel_ab.json").write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
