"""Decode / verify attention micro-benchmark at the Qwen3.6-27B attention shapes (24 q heads, 4 kv
heads, head_dim 256, 16 attention layers): one round = the 16 layers' attention launches (split +
combine) for W lanes at context ctx, captured in a CUDA graph, every layer its own K/V buffers (at
2K the 16 layers' 134 MB of bf16 KV already exceed the H200's 60 MB L2). Reported per (kv format,
kernel, ctx, W): ms per round, GB/s of KV read (the unique bytes: K + V rows, fp8 exponents
included) and that as a fraction of the streaming-read probe measured in the same run.

    python3 -m q27py.bench.attn_probe                       # 2K / 32K / 128K, W 1 8 16, bf16 fp8, split mma
    python3 -m q27py.bench.attn_probe --ctx 32768 --lanes 1 16 --kv fp8 --impl mma --json out.json
    python3 -m q27py.bench.attn_probe --ctx 2048 --kv fp8 --layers 1 --reps 3 --no-read-probe --check
                                                            # short: under compute-sanitizer, vs the spec

"split" is kernels.attention / attention_fp8 (one CTA per lane: a W-lane round reads the KV W
times, the L2 catching some of it); "mma" is kernels.attention_mma (the KV read once per round).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from q27py.bench.gemv_probe import read_probe
from q27py.bench.random_weights import _time_graph
from q27py.gpu import kernels as K
from q27py.gpu.graphs import capture
from q27py.gpu.runtime import Runtime

SHAPE_27B = dict(layers=16, nq=24, nkv=4, hd=256)
SPAN = 16  # the verify graphs' lane capacity (forward.VERIFY_SPAN)
# --check bounds on the relative error against float64: the split kernel and the hi + lo mma kernels
# are fp32-grade; the "_bq" mma kernels (Q, P rounded to bf16 once: sm_80-89 at head dim 256) ~1e-3
CHECK_TOL, CHECK_TOL_BQ = 1e-4, 1e-2


def kv_bytes(ctx: int, kv: str, layers: int, nkv: int, hd: int) -> int:
    """Unique KV bytes one round reads: K and V rows of ctx positions (+ the fp8 row exponents)."""
    per_row = hd * (1 if kv == "fp8" else 2) + (1 if kv == "fp8" else 0)
    return 2 * layers * nkv * ctx * per_row


def make_inputs(ctx: int, lanes: int, kv: str, layers: int, nq: int, nkv: int, hd: int, stream) -> dict:
    """Every layer's K / V (+ fp8 row exponents), q, gate, partials and pos0 for one probe row, made on
    `stream` (the one the round runs on) and finished before returning. The probe once made them on
    the legacy default stream and ran the first eager round on a non-blocking one, which does not wait
    for it: the attention kernels could read a pos0 not yet copied (stale memory: a position past the
    cache, the illegal address of issue 17) and K / V / q not yet filled."""
    rt = Runtime.get()
    cp = rt.cp
    max_pos = ctx + SPAN
    fp8 = kv == "fp8"
    with stream:
        rs = cp.random.RandomState(ctx + lanes)
        caches = []
        for _ in range(layers):
            if fp8:  # codes 0x00..0x6E (|value| <= 112: never the NaN code 0x7F), K signed
                kc = rs.randint(0, 0x6F, (nkv, max_pos, hd), dtype=cp.uint8) | (
                    rs.randint(0, 2, (nkv, max_pos, hd), dtype=cp.uint8) << 7)
                vc = rs.randint(0, 0x6F, (nkv, max_pos, hd), dtype=cp.uint8)
                kx = rs.randint(-12, -4, (nkv, max_pos), dtype=cp.int8)
                vx = rs.randint(-12, -4, (nkv, max_pos), dtype=cp.int8)
            else:
                kc = cp.empty((nkv, max_pos, hd), dtype=cp.uint16)
                vc = cp.empty_like(kc)
                for a in (kc, vc):
                    rt.launch("quant", "fill_random_bf16", min(-(-a.size // 256), 65535), 256,
                              (a, np.int64(a.size), np.uint64(ctx + 17), np.float32(-1.0), np.float32(1.0)))
                kx = vx = None
            caches.append((kc, vc, kx, vx))
        q = rs.standard_normal((SPAN, nq * hd), dtype=cp.float32)
        qg = rs.standard_normal((SPAN, 2 * nq * hd), dtype=cp.float32)
        out = cp.zeros((SPAN, nq * hd), cp.float32)
        nsplit = max(K.ATT_NSPLIT, K.attention_mma_splits(nkv, rt.sm_count))
        part = cp.zeros(K.attention_partials_floats(SPAN, nq, hd, nsplit), cp.float32)
        pos0 = cp.asarray(np.array([ctx - lanes], np.int32))  # the last lane sees ctx positions
    cp.cuda.Device().synchronize()  # all of it landed (any stream), before any kernel reads it
    return dict(caches=caches, q=q, qg=qg, out=out, part=part, pos0=pos0, max_pos=max_pos, fp8=fp8)


def enqueue_round(inp: dict, lanes: int, impl: str, nq: int, nkv: int, hd: int) -> None:
    """One round: every layer's attention launches (split + combine) for `lanes` lanes."""
    max_pos, fp8 = inp["max_pos"], inp["fp8"]
    q = inp["q"]
    args = (inp["pos0"], SPAN, inp["part"], inp["qg"], 2 * nq * hd, inp["out"], nq * hd, lanes)
    for kc, vc, kx, vx in inp["caches"]:
        if impl == "mma":
            K.attention_mma(q, nq * hd, kc, vc, kx, vx, fp8, max_pos, nq, nkv, hd, *args)
        elif fp8:
            K.attention_fp8(q, nq * hd, kc, vc, kx, vx, max_pos, nq, nkv, hd, *args)
        else:
            K.attention(q, nq * hd, kc, vc, True, max_pos, nq, nkv, hd, *args)


def reference_error(inp: dict, ctx: int, lanes: int, nq: int, nkv: int, hd: int) -> float:
    """Relative error of the round's output (the last layer's) against float64 attention over that
    layer's cache as stored (the numpy spec: kvformat dequantization, ops.attention, sigmoid gate)."""
    from q27py.gpu import layout as L
    from q27py.model import kvformat as F
    from q27py.model import ops

    kc, vc, kx, vx = inp["caches"][-1]
    if inp["fp8"]:
        kd = F.fp8_dequantize(kc[:, :ctx].get(), kx[:, :ctx].get())
        vd = F.fp8_dequantize(vc[:, :ctx].get(), vx[:, :ctx].get())
    else:
        kd, vd = L.bf16_to_f32(kc[:, :ctx].get()), L.bf16_to_f32(vc[:, :ctx].get())
    pos0 = ctx - lanes
    q = inp["q"][:lanes].get().reshape(lanes, nq, hd).astype(np.float64)
    gate = inp["qg"][:lanes].get().reshape(lanes, nq, 2 * hd)[..., hd:].astype(np.float64)
    keys = kd.transpose(1, 0, 2).astype(np.float64)
    vals = vd.transpose(1, 0, 2).astype(np.float64)
    want = ops.attention(q, keys, vals, np.arange(pos0, ctx), hd ** -0.5) * ops.sigmoid(gate)
    got = inp["out"][:lanes].get().reshape(lanes, nq, hd).astype(np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def measure(ctx: int, lanes: int, kv: str, impl: str, layers: int, nq: int, nkv: int, hd: int,
            reps: int = 20, check: bool = False) -> tuple[float, float | None]:
    """(milliseconds per round (median of graph replays), the eager round's relative error against
    the numpy spec when check, else None)."""
    rt = Runtime.get()
    cp = rt.cp
    stream = cp.cuda.Stream(non_blocking=True)
    inp = make_inputs(ctx, lanes, kv, layers, nq, nkv, hd, stream)
    err = None
    with stream:
        enqueue_round(inp, lanes, impl, nq, nkv, hd)  # compile + set shared-memory limits outside the capture
        stream.synchronize()
        if check:
            err = reference_error(inp, ctx, lanes, nq, nkv, hd)
        g = capture(lambda: enqueue_round(inp, lanes, impl, nq, nkv, hd), stream)
        ms = _time_graph(g, stream, reps)
    del inp, g
    cp.get_default_memory_pool().free_all_blocks()
    return ms, err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 32768, 131072])
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--kv", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    ap.add_argument("--impl", nargs="+", choices=list(K.ATTN_DECODE_MODES), default=list(K.ATTN_DECODE_MODES))
    ap.add_argument("--layers", type=int, default=SHAPE_27B["layers"], help="attention layers per round")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed per row")
    ap.add_argument("--no-read-probe", action="store_true",
                    help="skip the 2 GB streaming-read probe (%%read shows nan; for compute-sanitizer runs)")
    ap.add_argument("--no-pool", action="store_true",
                    help="every array its own cudaMalloc (no CuPy pool: compute-sanitizer then sees an overrun "
                         "past any one buffer, not only past a pooled block)")
    ap.add_argument("--check", action="store_true",
                    help="also check each row's eager round against float64 attention (the numpy spec)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    rt = Runtime.get()
    if args.no_pool:
        rt.cp.cuda.set_allocator(None)
    sh = dict(SHAPE_27B, layers=args.layers)
    probe = float("nan") if args.no_read_probe else read_probe()
    ns = K.attention_mma_splits(sh["nkv"], rt.sm_count)
    print(f"{rt.name}: streaming-read probe {probe:.0f} GB/s; 27B attention x{sh['layers']} layers; "
          f"mma: {ns} splits per kv head ({sh['nkv'] * ns} CTAs at most)")
    print(f"{'kv':5s} {'impl':5s} {'ctx':>7s} {'W':>3s} {'ms':>8s} {'KV GB/s':>8s} {'%read':>6s} {'vs W1':>6s} "
          f"{'splits':>6s}" + (f" {'rel err':>9s}" if args.check else ""))
    rows = []
    failed = 0
    for kv in args.kv:
        for impl in args.impl:
            for ctx in args.ctx:
                w1 = None
                for w in args.lanes:
                    if impl == "mma" and not K.attention_mma_supported(sh["hd"], sh["nq"], sh["nkv"], SPAN,
                                                                       kv == "fp8", ctx + SPAN):
                        print(f"{kv:5s} {impl:5s} {ctx:7d} {w:3d}  not supported on this card")
                        continue
                    ms, err = measure(ctx, w, kv, impl, **sh, reps=args.reps, check=args.check)
                    nb = kv_bytes(ctx, kv, sh["layers"], sh["nkv"], sh["hd"])
                    gbps = nb / ms / 1e6
                    w1 = ms if w1 is None else w1
                    used = -(-ctx // K.attention_mma_split_size(ctx - w, SPAN, ns)) if impl == "mma" else K.ATT_NSPLIT
                    rows.append({"kv": kv, "impl": impl, "ctx": ctx, "lanes": w, "ms": ms, "kv_bytes": nb,
                                 "GBps": gbps, "fraction_of_read": gbps / probe, "vs_w1": ms / w1, "splits": used,
                                 "rel_err": err})
                    print(f"{kv:5s} {impl:5s} {ctx:7d} {w:3d} {ms:8.3f} {gbps:8.0f} {gbps / probe:6.1%} "
                          f"{ms / w1:6.2f} {used:6d}" + ("" if err is None else f" {err:9.2e}"), flush=True)
                    bq = impl == "mma" and not K.attention_mma_qsplit(sh["hd"], rt.cc)
                    if err is not None and not err < (CHECK_TOL_BQ if bq else CHECK_TOL):
                        print(f"  CHECK FAILED: {kv} {impl} ctx {ctx} W={w} relative error {err:.2e}", flush=True)
                        failed += 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": rt.describe(), "read_probe_GBps": probe, "rows": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
