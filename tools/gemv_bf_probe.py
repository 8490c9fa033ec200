"""Probe of the prototype wide-lane q4 GEMV on bf16 activations (cuda/gemv_bf.cu, sm_90a) against the a8 tier
(kernels.GemvPlan, impl "a8" with its q4 launches on gemv_wg) on the 27B's q4 launches, in one process:

  GB/s per launch with the L2 defeated (distinct weight copies rotated, as q27py.bench.gemv_probe), per lane
  count and kernel variant, beside the streaming-read probe of the same run;
  error of each against an fp32 SGEMM of the bf16 expansion (blas.dequantize_to_bf16, the prefill route's weights)
  on the fp32 activations: max |y - ref| / max |ref| over all rows and lanes;
  lane independence: lane 0's (and lane 5's) output bits at every launch width of the prototype.

The a8 figures include its quant_act8 launches (its real cost); the prototype's bf16 activation rows are made
once outside the timed graph (a producer would write them). Matrices whose plan splits K are measured up to 32
lanes only (the plan's split-K workspace is sized for 32).

    PYTHONPATH=. python3 tools/gemv_bf_probe.py [--shapes gate_up down ...] [--lanes 1 8 16 32 64]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from q27py.bench.gemv_probe import L2_DEFEAT_BYTES, MAX_COPIES, read_probe
from q27py.bench.random_weights import _time_graph
from q27py.gpu import constants as C
from q27py.gpu import kernels as K
from q27py.gpu import layout as L
from q27py.gpu.graphs import capture
from q27py.gpu.runtime import Runtime

# the 27B's q4 launches (rows, cols) and launches per forward (48 GDN + 16 attention layers)
SHAPES = {
    "gate_up": ((34816, 5120), 64),
    "down": ((5120, 17408), 64),
    "gdn_in": ((16384, 5120), 48),
    "gdn_out": ((5120, 6144), 48),
    "attn_in": ((12288, 5120), 16),
    "attn_o": ((5120, 6144), 16),
    "lm_head": ((248320, 5120), 1),
}

# cuda/gemv_bf.cu's entries: name -> (lanes, chunks a stage, stages)
VARIANTS = {
    "gemvb_q4_n8_c2s6k5": (8, 2, 6),
    "gemvb_q4_n8_c4s4k4": (8, 4, 4),
    "gemvb_q4_n16_c2s6k4": (16, 2, 6),
    "gemvb_q4_n16_c4s4k3": (16, 4, 4),
    "gemvb_q4_n32_c2s5k3": (32, 2, 5),
    "gemvb_q4_n32_c4s3k2": (32, 4, 3),
    "gemvb_q4_n64_c2s4k2": (64, 2, 4),
    "gemvb_q4_n64_c1s6k2": (64, 1, 6),
}


def smem_bytes(nl: int, cps: int, stages: int) -> int:
    """WbStage<NL, CPS>::BYTES x stages (the unit's reduced tile reuses the ring)."""
    stage = cps * (C.GEMV_R * 512 + C.GEMV_R * 32 + nl * 128)
    return max(stages * stage, 64 * nl * 4)


def width(n: int) -> int:
    return next(w for w in (8, 16, 32, 64) if w >= n)


def to_bf16_bits(cp, x):
    u = x.view(cp.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cp.uint16)


def launch_bf(rt, name: str, plan, xb, kpad: int, n: int) -> None:
    fmt, desc, nmat, units = plan.launches[0]
    assert fmt == L.FMT_Q4 and len(plan.launches) == 1
    nl, cps, st = VARIANTS[name]
    rt.launch("gemv_bf", name, units, 128, (desc, np.int32(nmat), np.int32(units), xb, np.int32(kpad), np.int32(n),
                                              np.int32(0)), shared_mem=smem_bytes(nl, cps, st))


def probe_shape(rt, name: str, lanes: list[int], variants: list[str], check: bool) -> dict:
    cp = rt.cp
    (rows, cols), _per = SHAPES[name]
    shape = L.matrix_shape(rows, cols, L.FMT_Q4)
    one = shape.code_bytes + shape.scale_bytes
    copies = int(min(MAX_COPIES, max(2, -(-L2_DEFEAT_BYTES // one))))
    mats = [K.random_matrix(rows, cols, L.FMT_Q4, seed=7000 + i, scale=0.01) for i in range(copies)]
    kpad = shape.kpad
    maxl = max(64, *lanes)
    x = cp.zeros((maxl, kpad), dtype=cp.float32)
    K.fill_uniform(x, 3, -1, 1)
    xb = cp.ascontiguousarray(to_bf16_bits(cp, x))
    y = cp.zeros((maxl, rows), dtype=cp.float32)
    ws = K.Workspace()
    plans = [K.GemvPlan([m], [(y, rows)], ws, impl="a8", wgmma="all") for m in mats]
    split = int(plans[0].desc_host[0][1][:, C.D_SPLITS].max()) > 1  # any piece split over K (tails included)
    stream = cp.cuda.Stream(non_blocking=True)
    out = {"bytes": one, "copies": copies, "splits": list(plans[0].splits), "units": plans[0].launches[0][3],
           "a8w": {}, "bf": {}}
    for n in lanes:
        with stream:
            g = capture(lambda: [p.run(x, kpad, n, allow_gemm=False) for p in plans], stream)
            out["a8w"][n] = _time_graph(g, stream, 12) * 1e3 / copies
    for v in variants:
        nl = VARIANTS[v][0]
        for n in lanes:
            if width(n) != nl or (split and nl > 32):
                continue
            with stream:
                g = capture(lambda: [launch_bf(rt, v, p, xb, kpad, n) for p in plans], stream)
                out["bf"].setdefault(v, {})[n] = _time_graph(g, stream, 12) * 1e3 / copies
    if check:
        out["check"] = check_shape(rt, plans[0], mats[0], x, xb, y, kpad, rows, variants, split)
    del plans, mats
    cp.get_default_memory_pool().free_all_blocks()
    return out


def check_shape(rt, plan, m, x, xb, y, kpad: int, rows: int, variants: list[str], split: bool) -> dict:
    """Errors against the fp32 SGEMM of the bf16 expansion, and lane 0 / lane 5 bits across launch widths."""
    from q27py.gpu import blas

    cp = rt.cp
    w = blas.dequantize_to_bf16(m)[: m.shape.row_tiles * 16 * kpad].reshape(m.shape.row_tiles * 16, kpad)
    rc = min(rows, 16384)  # the reference's rows (the lm_head's whole fp32 expansion would be 5 GB)
    w32 = (w[:rc].astype(cp.uint32) << 16).view(cp.float32)
    res = {}
    nmax = 32 if split else 64
    ref = x[:nmax] @ w32.T
    scale = float(cp.abs(ref).max())
    y.fill(float("nan"))
    plan.run(x, kpad, nmax, allow_gemm=False)
    res["a8_err"] = float(cp.abs(y[:nmax, :rc] - ref).max()) / scale
    lane_bits = {}
    for v in variants:
        nl = VARIANTS[v][0]
        if split and nl > 32:
            continue
        y.fill(float("nan"))
        launch_bf(rt, v, plan, xb, kpad, nl)
        got = y[:nl, :rc].copy()
        res[f"{v}_err"] = float(cp.abs(got - ref[:nl]).max()) / scale
        res[f"{v}_finite"] = bool(cp.isfinite(got).all())
        lane_bits[v] = (got[0].view(cp.uint32).get(), got[5].view(cp.uint32).get())
        if nl == 8:  # one lane alone
            y.fill(float("nan"))
            launch_bf(rt, v, plan, xb, kpad, 1)
            lane_bits[v + "@1"] = (y[0, :rc].view(cp.uint32).get(), None)
    names = list(lane_bits)
    base0 = lane_bits[names[0]][0]
    res["lane0_same_bits_all_widths"] = all(np.array_equal(base0, b[0]) for b in lane_bits.values())
    fives = [b[1] for b in lane_bits.values() if b[1] is not None]
    res["lane5_same_bits_all_widths"] = all(np.array_equal(fives[0], b) for b in fives)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--lanes", nargs="+", type=int, default=[1, 8, 16, 32, 64])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--json", default=None, help="write the raw figures here")
    args = ap.parse_args(argv)
    rt = Runtime.get()
    if not K.gemv_wgmma_supported():
        print("gemv_bf needs sm_90a (wgmma)", file=sys.stderr)
        return 2
    gbs_probe = read_probe()
    print(f"{rt.cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}: read probe {gbs_probe:.0f} GB/s")
    allres = {"read_probe_gbs": gbs_probe, "shapes": {}}
    fam = {"a8w": {}, "best_bf": {}}
    for name in args.shapes:
        r = probe_shape(rt, name, args.lanes, args.variants, not args.no_check)
        allres["shapes"][name] = r
        per = SHAPES[name][1]
        cells = []
        for n in args.lanes:
            a = r["a8w"][n]
            bfs = {v: t[n] for v, t in r["bf"].items() if n in t}
            best = min(bfs.items(), key=lambda kv: kv[1]) if bfs else None
            fam["a8w"][n] = fam["a8w"].get(n, 0.0) + a * per
            if best:
                fam["best_bf"][n] = fam["best_bf"].get(n, 0.0) + best[1] * per
            else:
                fam["best_bf"][n] = fam["best_bf"].get(n, 0.0) + a * per  # not measured: the a8 launch
            cells.append(f"{n}: a8w {r['bytes'] / a / 1e3:6.0f}" + (f" bf {r['bytes'] / best[1] / 1e3:6.0f} ({best[0][6:]})"
                                                                     if best else " bf      -"))
        print(f"{name:8s} {r['bytes'] / 1e6:7.1f} MB s={r['splits']} GB/s  " + " | ".join(cells))
        for v, t in r["bf"].items():
            print(f"    {v:22s} " + " ".join(f"{n}:{r['bytes'] / us / 1e3:6.0f}" for n, us in t.items()))
        if "check" in r:
            print("    check " + json.dumps(r["check"], default=float))
    tot = sum(L.matrix_shape(*SHAPES[s][0], L.FMT_Q4).code_bytes + L.matrix_shape(*SHAPES[s][0], L.FMT_Q4).scale_bytes
              for s in args.shapes for _ in range(SHAPES[s][1]))
    print("q4 family per forward (the shapes given): " + " | ".join(
        f"{n}: a8w {fam['a8w'][n] / 1e3:.2f} ms ({tot / fam['a8w'][n] / 1e3:.0f} GB/s), "
        f"bf {fam['best_bf'][n] / 1e3:.2f} ms ({tot / fam['best_bf'][n] / 1e3:.0f} GB/s, "
        f"{100 * tot / fam['best_bf'][n] / 1e3 / gbs_probe:.0f}% of read)" for n in args.lanes))
    allres["family_us"] = fam
    if args.json:
        with open(args.json, "w") as f:
            json.dump(allres, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
