"""Every kernel in cuda/ against the numpy reference (q27py/model/ops.py, q27py/gpu/layout.py)
on random inputs. Outputs are poisoned with NaN before each launch, so an unwritten element
fails. Tolerances (relative L2 unless stated):
  GEMV vs float64 with the same dequantized weights: 2e-5. bf16 weights see the activations
    as bf16 hi+lo (~2^-17 per element); q8/q4 weights see them rounded to bf16 once (the
    reference rounds them too), the weights exactly.
  fp32 elementwise / reduction kernels (norms, conv, rope, GDN, attention on fp32 KV): 2e-5.
  attention on bf16 KV vs fp32 math on the bf16-rounded cache: 2e-5.
Bitwise checks: lane results independent of the launch width; GPU packer == numpy packer;
verify + commit == decode steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from q27py.gpu import layout as L
from q27py.model import ops

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu.runtime import Runtime

    Runtime.get().warm_all()
    return cupy


@pytest.fixture(scope="module")
def K(cp):
    from q27py.gpu import kernels

    return kernels


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def poisoned(cp, shape):
    return cp.full(shape, np.nan, dtype=cp.float32)


def padded_x(cp, x: np.ndarray, kpad: int):
    buf = np.zeros((x.shape[0], kpad), dtype=np.float32)
    buf[:, : x.shape[1]] = x
    return cp.asarray(buf)


# ---------------------------------------------------------------- GEMV (both implementations)
GEMV_SHAPES = [(300, 640), (96, 5120), (1040, 256), (37, 200)]
IMPLS = ["v1", "v2", "a8"]
# v2 partitions (row groups per CTA, splits) forced in some tests, so every reduction path runs
V2_PARTITIONS = [(1, 1), (2, 3), (4, 2), (1, 5)]


def quantized_x(x: np.ndarray, fmt: int, impl: str = "v1") -> np.ndarray:
    """What the kernels multiply by: bf16 weights see x (hi + lo, fp32-grade), q8/q4 bf16(x), or
    with impl a8 the int8 codes x chunk scales of quant_act8 (layout.quantize_act8, bit-exact)."""
    if fmt == L.FMT_BF16:
        return x
    if impl == "a8":
        kpad = L.round_up(x.shape[1], L.CHUNK_K)
        xp = np.zeros((x.shape[0], kpad), np.float32)
        xp[:, : x.shape[1]] = x
        return L.dequantize_act8(*L.quantize_act8(xp))[:, : x.shape[1]]
    return L.bf16_to_f32(L.bf16_bits(x))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", [L.FMT_BF16, L.FMT_Q8, L.FMT_Q4])
@pytest.mark.parametrize("rows,cols", GEMV_SHAPES)
def test_gemv_matches_float64(cp, K, impl, fmt, rows, cols):
    rng = np.random.default_rng(rows + cols + fmt)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    pm = L.pack_matrix(w, fmt)
    wd = L.unpack(pm).astype(np.float64)
    m = K.upload_packed(pm)
    ws = K.Workspace()
    for n in (1, 3, 8, 9, 16):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        y = poisoned(cp, (n, rows))
        plan = K.GemvPlan([m], [(y, rows)], ws, impl=impl)
        plan.run(padded_x(cp, x, pm.shape.kpad), pm.shape.kpad, n)
        got = y.get()
        assert np.isfinite(got).all(), f"unwritten outputs at n={n}"
        ref = quantized_x(x, fmt, impl).astype(np.float64) @ wd.T
        assert rel(got, ref) < 2e-5, (n, rel(got, ref))


def tile_subset(K, m, t0: int, t1: int) -> L.PackedMatrix:
    """Row tiles [t0, t1) of a device matrix as a host PackedMatrix (the layout is tile-major)."""
    sh = m.shape
    cb = L.CHUNK_BYTES[sh.fmt]
    rows = min(sh.rows, 16 * t1) - 16 * t0
    sub = L.matrix_shape(rows, sh.cols, sh.fmt, sh.group)
    assert sub.row_tiles == t1 - t0, "subsets are whole row groups"
    codes = m.codes[t0 * sh.kchunks * cb : t1 * sh.kchunks * cb].get()
    scales = np.zeros(0, np.uint32) if m.scales is None else m.scales[t0 * sh.groups * 8 : t1 * sh.groups * 8].get()
    return L.PackedMatrix(sub, codes, scales)


# The Qwen3.6-27B matrices (q27py/gpu/weights.py random_weights recipe; q4s tier formats): full
# shapes, so the real partitions (row groups per CTA, splits) run; checked on the first and last
# 128 rows against float64.
SHAPES_27B = {
    "gate_up": (34816, 5120, L.FMT_Q4), "down": (5120, 17408, L.FMT_Q4), "qkvz": (16384, 5120, L.FMT_Q4),
    "gdn_ab": (96, 5120, L.FMT_BF16), "gdn_out": (5120, 6144, L.FMT_Q4), "attn_q": (12288, 5120, L.FMT_Q4),
    "attn_kv": (2048, 5120, L.FMT_Q8), "attn_o": (5120, 6144, L.FMT_Q4), "lm_head": (248320, 5120, L.FMT_Q4),
    "mtp_gate_up_q8": (34816, 5120, L.FMT_Q8), "mtp_fc_q8": (5120, 10240, L.FMT_Q8),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", sorted(SHAPES_27B))
def test_gemv_27b_shapes_match_float64(cp, K, impl, name):
    rows, cols, fmt = SHAPES_27B[name]
    m = K.random_matrix(rows, cols, fmt, seed=len(name), scale=0.01 if fmt != L.FMT_BF16 else 0.05)
    sh = m.shape
    ws = K.Workspace()
    rng = np.random.default_rng(len(name) + 100)
    x = rng.standard_normal((16, cols)).astype(np.float32)
    xd = padded_x(cp, x, sh.kpad)
    last = sh.row_tiles
    parts = [(0, 8), (last - 8, last)]  # first and last 128 rows (row tiles are padded to groups of 4)
    refs = [quantized_x(x, fmt, impl).astype(np.float64) @ L.unpack(tile_subset(K, m, a, b)).astype(np.float64).T
            for a, b in parts]
    for n in (1, 8, 16):
        y = poisoned(cp, (n, rows))
        K.GemvPlan([m], [(y, rows)], ws, impl=impl).run(xd, sh.kpad, n)
        got = y.get()
        assert np.isfinite(got).all(), f"unwritten outputs at n={n}"
        for (a, b), ref in zip(parts, refs):
            sel = got[:, 16 * a : min(rows, 16 * b)]
            assert rel(sel, ref[:n]) < 2e-5, (name, n, a, rel(sel, ref[:n]))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", [L.FMT_BF16, L.FMT_Q8, L.FMT_Q4])
def test_gemv_lanes_are_width_invariant(cp, K, impl, fmt):
    """Lane t's bits never depend on how many lanes share the launch (1..16; 8 -> 9 switches kernel)."""
    rng = np.random.default_rng(7)
    rows, cols = 200, 1024
    pm = L.pack_matrix(rng.standard_normal((rows, cols)).astype(np.float32), fmt)
    m = K.upload_packed(pm)
    ws = K.Workspace()
    x = padded_x(cp, rng.standard_normal((16, cols)).astype(np.float32), pm.shape.kpad)
    parts = [None, *V2_PARTITIONS] if impl == "v2" else [None]
    for part in parts:
        outs = {}
        for n in range(1, 17):
            y = poisoned(cp, (16, rows))
            K.GemvPlan([m], [(y, rows)], ws, impl=impl, partition=part).run(x, pm.shape.kpad, n)
            outs[n] = y.get()
        for n in range(1, 17):
            for t in range(n):
                np.testing.assert_array_equal(outs[n][t], outs[16][t], err_msg=f"partition {part}, n={n}, lane {t}")


@pytest.mark.parametrize("impl", IMPLS)
def test_gemv_split_k_is_repeatable_and_lane_offset_works(cp, K, impl):
    rng = np.random.default_rng(8)
    rows, cols = 64, 8192  # few row groups, long K: many splits and the last-CTA reduction
    pm = L.pack_matrix(rng.standard_normal((rows, cols)).astype(np.float32), L.FMT_Q4)
    m = K.upload_packed(pm)
    ws = K.Workspace()
    x = padded_x(cp, rng.standard_normal((20, cols)).astype(np.float32), pm.shape.kpad)
    y1, y2 = poisoned(cp, (20, rows)), poisoned(cp, (20, rows))
    p1 = K.GemvPlan([m], [(y1, rows)], ws, impl=impl)
    assert p1.splits[0] > 1
    p1.run(x, pm.shape.kpad, 20)  # 16 + 4 lanes: two launches, the second at lane0 = 16
    for _ in range(3):  # same bits every run (fixed-order split reduction, counters re-armed)
        K.GemvPlan([m], [(y2, rows)], ws, impl=impl).run(x, pm.shape.kpad, 20)
        np.testing.assert_array_equal(y1.get(), y2.get())
    ref = quantized_x(x.get()[:, :cols], L.FMT_Q4, impl).astype(np.float64) @ L.unpack(pm).astype(np.float64).T
    assert rel(y1.get(), ref) < 2e-5
    # lane0: lanes 5..11 alone land in rows 5..11 of y with the same bits as the full run
    y3 = poisoned(cp, (20, rows))
    p3 = K.GemvPlan([m], [(y3, rows)], ws, impl=impl)
    p3.run(x, pm.shape.kpad, 7, lane0=5)
    got = y3.get()
    np.testing.assert_array_equal(got[5:12], y1.get()[5:12])
    assert np.isnan(got[:5]).all() and np.isnan(got[12:]).all()


def test_quant_act8_matches_numpy_spec_bitwise(cp, K):
    """quant_act8's codes (in fragment order) and chunk scales equal layout.quantize_act8 bit for bit,
    including an all-zero chunk, a lane offset, and huge / tiny magnitudes."""
    from q27py.gpu.runtime import Runtime, i32

    rng = np.random.default_rng(31)
    n, kpad = 13, 1024
    x = (rng.standard_normal((n + 2, kpad)) * np.exp(rng.uniform(-20, 20, (n + 2, 1)))).astype(np.float32)
    x[3, 128:192] = 0.0
    xq = cp.full((16, kpad), 0xAB, dtype=cp.uint8)
    xs = cp.full((kpad // 64, 16), np.nan, dtype=cp.float32)
    xd = cp.asarray(x)
    Runtime.get().launch("gemv", "quant_act8", (kpad // 64 // 8, n), 256, (xd[2:], i32(kpad), i32(kpad // 64), xq, i32(kpad), xs))
    codes, scales = L.quantize_act8(x[2:])
    np.testing.assert_array_equal(xq.get()[:n], L.act8_fragment_bytes(codes))
    np.testing.assert_array_equal(xs.get()[:, :n], scales.T)


@pytest.mark.parametrize("h", [5120, 1000, 9000])
def test_rmsnorm_a8_fuses_quant_bitwise(cp, K, h):
    """rmsnorm_rows_a8 writes rmsnorm_rows's fp32 row and, from it, the a8 plan's int8 activations:
    a prequantized plan run gives the bits of the unfused pair (rmsnorm, then run with quant_act8).
    1000: the last chunk's padded tail (the staged copy must read it as zero); 9000: a row longer
    than NORM_A8_MAX_K quantizes from global memory instead of the staged copy."""
    rng = np.random.default_rng(41)
    rows, n = 300, 7
    kpad = L.round_up(h, L.CHUNK_K)
    pm = L.pack_matrix(rng.standard_normal((rows, h)).astype(np.float32) * 0.05, L.FMT_Q4)
    m = K.upload_packed(pm)
    x = cp.asarray(rng.standard_normal((n, h)).astype(np.float32) * 3)
    w = cp.asarray(rng.standard_normal(h).astype(np.float32) * 0.1)
    ws = K.Workspace()
    y1, y2 = poisoned(cp, (n, rows)), poisoned(cp, (n, rows))
    p1, p2 = K.GemvPlan([m], [(y1, rows)], ws, impl="a8"), K.GemvPlan([m], [(y2, rows)], ws, impl="a8")
    xa, xb = cp.zeros((n, kpad), cp.float32), cp.zeros((n, kpad), cp.float32)
    K.rmsnorm(x, h, w, 1e-6, h, xa, kpad, n)
    p1.run(xa, kpad, n)
    K.rmsnorm(x, h, w, 1e-6, h, xb, kpad, n, a8=p2)
    p2.run(xb, kpad, n, prequantized=True)
    np.testing.assert_array_equal(xa.get(), xb.get())
    np.testing.assert_array_equal(y1.get(), y2.get())
    codes, scales = L.quantize_act8(xa.get())
    np.testing.assert_array_equal(p2.xq.get()[:n, :kpad], L.act8_fragment_bytes(codes))


@pytest.mark.parametrize("hv,dv", [(48, 128), (4, 64), (3, 192)])
def test_gated_rmsnorm_a8_fuses_quant_bitwise(cp, K, hv, dv):
    """gated_rmsnorm_a8 (the GDN output norm that also writes the out projection's a8 activations)
    gives gated_rmsnorm's fp32 rows, quant_act8's bytes of them, and so the unfused GEMV bits."""
    rng = np.random.default_rng(43)
    rows, n, k = 260, 5, hv * dv
    m = K.upload_packed(L.pack_matrix(rng.standard_normal((rows, k)).astype(np.float32) * 0.05, L.FMT_Q4))
    o = cp.asarray(rng.standard_normal((n, k)).astype(np.float32))
    z = cp.asarray(rng.standard_normal((n, k)).astype(np.float32) * 2)
    w = cp.asarray(rng.standard_normal(dv).astype(np.float32) * 0.3)
    ws = K.Workspace()
    y1, y2 = poisoned(cp, (n, rows)), poisoned(cp, (n, rows))
    p1, p2 = K.GemvPlan([m], [(y1, rows)], ws, impl="a8"), K.GemvPlan([m], [(y2, rows)], ws, impl="a8")
    assert K.gated_rmsnorm_fuses(p2, n, hv, dv)
    xa, xb = cp.zeros((n, k), cp.float32), cp.zeros((n, k), cp.float32)
    K.gated_rmsnorm(o, k, z, k, w, 1e-6, n, hv, dv, xa, k)
    p1.run(xa, k, n)
    K.gated_rmsnorm(o, k, z, k, w, 1e-6, n, hv, dv, xb, k, a8=p2)
    p2.run(xb, k, n, prequantized=True)
    np.testing.assert_array_equal(xa.get(), xb.get())
    np.testing.assert_array_equal(y1.get(), y2.get())
    codes, _ = L.quantize_act8(xa.get())
    np.testing.assert_array_equal(p2.xq.get()[:n, :k], L.act8_fragment_bytes(codes))


@pytest.mark.parametrize("part", V2_PARTITIONS)
def test_gemv_v2_partitions_agree(cp, K, part):
    """Every v2 partition (row groups per CTA x splits, incl. a partial last block) computes the
    same function; and a forced split count above 1 re-runs with identical bits."""
    rng = np.random.default_rng(21)
    rows, cols = 328, 2048  # 6 row groups: blocks of 4 leave a partial block
    for fmt in (L.FMT_Q4, L.FMT_Q8, L.FMT_BF16):
        pm = L.pack_matrix(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, fmt)
        m = K.upload_packed(pm)
        ws = K.Workspace()
        x = rng.standard_normal((11, cols)).astype(np.float32)
        ref = quantized_x(x, fmt).astype(np.float64) @ L.unpack(pm).astype(np.float64).T
        ys = []
        for _ in range(2):
            y = poisoned(cp, (11, rows))
            K.GemvPlan([m], [(y, rows)], ws, impl="v2", partition=part).run(padded_x(cp, x, cols), cols, 11)
            ys.append(y.get())
        assert rel(ys[0], ref) < 2e-5, (fmt, rel(ys[0], ref))
        np.testing.assert_array_equal(ys[0], ys[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_gemv_residual_add_and_multi_matrix(cp, K, impl):
    rng = np.random.default_rng(9)
    cols = 512
    wa = rng.standard_normal((130, cols)).astype(np.float32) * 0.1
    wb = rng.standard_normal((48, cols)).astype(np.float32) * 0.1
    wc = rng.standard_normal((300, cols)).astype(np.float32) * 0.1
    pa, pb, pc = L.pack_matrix(wa, L.FMT_Q4), L.pack_matrix(wb, L.FMT_BF16), L.pack_matrix(wc, L.FMT_Q4)
    ma = K.upload_packed(pa, mode=K.MODE_ADD)
    mb = K.upload_packed(pb)
    mc = K.upload_packed(pc)
    for n in (5, 13):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        base = rng.standard_normal((n, 130)).astype(np.float32)
        ya, yb, yc = cp.asarray(base), poisoned(cp, (n, 48)), poisoned(cp, (n, 300))
        # two q4 matrices share one launch (descriptor rows), the bf16 one gets its own
        plan = K.GemvPlan([ma, mb, mc], [(ya, 130), (yb, 48), (yc, 300)], K.Workspace(), impl=impl)
        assert len(plan.launches) == 2
        plan.run(padded_x(cp, x, 512), 512, n)
        xb = quantized_x(x, L.FMT_Q4, impl).astype(np.float64)
        assert rel(ya.get(), base + xb @ L.unpack(pa).T) < 2e-5
        assert rel(yb.get(), x.astype(np.float64) @ L.unpack(pb).T) < 2e-5
        assert rel(yc.get(), xb @ L.unpack(pc).T) < 2e-5


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", [L.FMT_Q4, L.FMT_Q8, L.FMT_BF16])
def test_gemv_swiglu_epilogue(cp, K, impl, fmt):
    rng = np.random.default_rng(10)
    inter, cols = 100, 256
    gate = rng.standard_normal((inter, cols)).astype(np.float32) * 0.1
    up = rng.standard_normal((inter, cols)).astype(np.float32) * 0.1
    pm = L.pack_matrix(L.interleave_gate_up(gate, up), fmt)
    m = K.upload_packed(pm, mode=K.MODE_SWIGLU, out_rows=inter)
    wd = L.unpack(pm).astype(np.float64)
    for n in (4, 16):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        y = poisoned(cp, (n, inter))
        K.GemvPlan([m], [(y, inter)], K.Workspace(), impl=impl).run(padded_x(cp, x, 256), 256, n)
        gu = quantized_x(x, fmt, impl).astype(np.float64) @ wd.T  # interleaved rows
        tiles = gu.reshape(n, -1, 2, 8)
        g, u = tiles[:, :, 0, :].reshape(n, -1)[:, :inter], tiles[:, :, 1, :].reshape(n, -1)[:, :inter]
        assert rel(y.get(), ops.silu(g) * u) < 2e-5


@pytest.mark.parametrize("fmt", [L.FMT_Q8, L.FMT_Q4])
@pytest.mark.parametrize("mode", ["store", "add", "swiglu"])
def test_prefill_gemm_matches_float64(cp, K, fmt, mode):
    rng = np.random.default_rng(30 + fmt)
    rows, cols, ntok = 300, 640, 100  # ragged rows, a partial token tile
    if mode == "swiglu":
        w = L.interleave_gate_up(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05,
                                 rng.standard_normal((rows, cols)).astype(np.float32) * 0.05)
    else:
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    pm = L.pack_matrix(w, fmt)
    kmode = {"store": K.MODE_STORE, "add": K.MODE_ADD, "swiglu": K.MODE_SWIGLU}[mode]
    m = K.upload_packed(pm, mode=kmode, out_rows=rows if mode == "swiglu" else None)
    x = rng.standard_normal((ntok, cols)).astype(np.float32)
    base = rng.standard_normal((ntok, rows)).astype(np.float32)
    y = cp.asarray(base) if mode == "add" else poisoned(cp, (ntok, rows))
    plan = K.GemvPlan([m], [(y, rows)], K.Workspace())
    plan.run(padded_x(cp, x, pm.shape.kpad), pm.shape.kpad, ntok)  # >= 32 tokens: the GEMM
    full = L.bf16_to_f32(L.bf16_bits(x)).astype(np.float64) @ L.unpack(pm).astype(np.float64).T
    if mode == "swiglu":
        t = full.reshape(ntok, -1, 2, 8)
        ref = ops.silu(t[:, :, 0, :].reshape(ntok, -1)[:, :rows]) * t[:, :, 1, :].reshape(ntok, -1)[:, :rows]
    else:
        ref = full + (base if mode == "add" else 0)
    assert rel(y.get(), ref) < 2e-5
    # the v1 GEMV path (16 lanes at a time, the same bf16-activation math) agrees to rounding; the a8
    # default GEMV is its own tolerance class (int8 activations: test_gemv_* [a8], docs/QUANT.md)
    y2 = cp.asarray(base) if mode == "add" else poisoned(cp, (ntok, rows))
    K.GemvPlan([m], [(y2, rows)], K.Workspace(), impl="v1").run(padded_x(cp, x, pm.shape.kpad), pm.shape.kpad, ntok,
                                                     allow_gemm=False)
    assert rel(y.get(), y2.get()) < 2e-5


@pytest.mark.parametrize("fmt", [L.FMT_BF16, L.FMT_Q8, L.FMT_Q4])
@pytest.mark.parametrize("src_bf16", [False, True])
def test_gpu_packer_matches_numpy_packer(cp, K, fmt, src_bf16):
    rng = np.random.default_rng(11 + fmt)
    rows, cols = 45, 200
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w[3, :64] = 0.0  # an all-zero group: scale 0, codes 0
    if src_bf16:
        bits = L.bf16_bits(w)
        w = L.bf16_to_f32(bits)
        src = cp.asarray(bits)
    else:
        src = cp.asarray(w)
    ref = L.pack_matrix(w, fmt)
    got = K.pack_on_gpu(src, rows, cols, fmt, src_bf16=src_bf16)
    np.testing.assert_array_equal(got.codes.get(), ref.codes)
    if fmt != L.FMT_BF16:
        np.testing.assert_array_equal(got.scales.get(), ref.scales)


def test_random_matrix_is_seeded_and_sane(cp, K):
    a = K.random_matrix(256, 512, L.FMT_Q4, seed=5, scale=0.01)
    b = K.random_matrix(256, 512, L.FMT_Q4, seed=5, scale=0.01)
    np.testing.assert_array_equal(a.codes.get(), b.codes.get())
    deq = L.unpack(L.PackedMatrix(a.shape, a.codes.get(), a.scales.get()))
    assert np.isfinite(deq).all() and 0.02 < deq.std() < 0.07


# ---------------------------------------------------------------- embeddings and norms
@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8"])
def test_embed_rows(cp, K, fmt):
    rng = np.random.default_rng(12)
    v, h = 50, 200
    table = rng.standard_normal((v, h)).astype(np.float32)
    code = {"f32": K.TAB_F32, "bf16": K.TAB_BF16, "q8": K.TAB_Q8}[fmt]
    tab = K.table_on_gpu(cp.asarray(table), v, h, code)
    ids = np.array([3, 0, 49, 3], dtype=np.int32)
    out = poisoned(cp, (4, 256))
    K.embed(cp.asarray(ids), 4, tab, h, out, 256)
    if fmt == "f32":
        expect = table[ids]
    elif fmt == "bf16":
        expect = L.bf16_to_f32(L.bf16_bits(table))[ids]
    else:
        codes, scales = L.quantize(table, L.FMT_Q8, 128)
        expect = L.dequantize(codes, scales, 128)[ids]
    np.testing.assert_allclose(out.get()[:, :h], expect, rtol=1e-6, atol=1e-7)


def test_rmsnorm_rows(cp, K):
    rng = np.random.default_rng(13)
    x = rng.standard_normal((5, 300)).astype(np.float32) * 3
    w = rng.standard_normal(300).astype(np.float32) * 0.1
    y = poisoned(cp, (5, 320))
    K.rmsnorm(cp.asarray(x), 300, cp.asarray(w), 1e-6, 300, y, 320, 5)
    assert rel(y.get()[:, :300], ops.rms_norm(x.astype(np.float64), w, 1e-6)) < 2e-6
    y2 = poisoned(cp, (5, 300))
    K.rmsnorm(cp.asarray(x), 300, cp.asarray(w), 1e-6, 300, y2, 300, 5, add_one=False)
    var = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    assert rel(y2.get(), x / np.sqrt(var + 1e-6) * w) < 2e-6


def test_gated_rmsnorm(cp, K):
    rng = np.random.default_rng(14)
    t, hv, dv = 3, 6, 64
    o = rng.standard_normal((t, hv * dv)).astype(np.float32)
    z = rng.standard_normal((t, hv * dv + 10)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    y = poisoned(cp, (t, hv * dv))
    K.gated_rmsnorm(cp.asarray(o), hv * dv, cp.asarray(z), hv * dv + 10, cp.asarray(w), 1e-6, t, hv, dv, y, hv * dv)
    ref = ops.rms_norm_gated(o.reshape(t, hv, dv).astype(np.float64), z[:, : hv * dv].reshape(t, hv, dv), w, 1e-6)
    assert rel(y.get(), ref.reshape(t, -1)) < 2e-6


# ---------------------------------------------------------------- Gated DeltaNet
GDN_DIMS = {"tiny": dict(h=4, hv=8, dk=16, dv=8), "small": dict(h=2, hv=6, dk=64, dv=64),
            "k32": dict(h=2, hv=6, dk=32, dv=32), "27b": dict(h=16, hv=48, dk=128, dv=128)}


def conv_inputs(rng, t, h, hv, dk, dv, kw=4):
    c = 2 * h * dk + hv * dv
    raw = rng.standard_normal((t, c)).astype(np.float32)
    window = rng.standard_normal((kw - 1, c)).astype(np.float32)
    convw = (rng.standard_normal((c, kw)) * 0.5).astype(np.float32)
    ab = rng.standard_normal((t, 2 * hv)).astype(np.float32)
    neg_a = (-np.exp(rng.standard_normal(hv) * 0.5)).astype(np.float32)
    dt = rng.standard_normal(hv).astype(np.float32)
    return c, raw, window, convw, ab, neg_a, dt


@pytest.mark.parametrize("dims", sorted(GDN_DIMS))
def test_gdn_conv_gates_and_norms(cp, K, dims):
    d = GDN_DIMS[dims]
    h, hv, dk, dv = d["h"], d["hv"], d["dk"], d["dv"]
    rng = np.random.default_rng(15)
    t = 5
    c, raw, window, convw, ab, neg_a, dt = conv_inputs(rng, t, h, hv, dk, dv)
    qkvn, gb = poisoned(cp, (t, c)), poisoned(cp, (t, 2 * hv))
    K.gdn_conv(cp.asarray(raw), c, cp.asarray(window), cp.asarray(convw), cp.asarray(ab), 2 * hv, cp.asarray(neg_a),
               cp.asarray(dt), h, hv, dk, dv, 4, qkvn, gb, t)
    y, _ = ops.causal_conv1d(raw.astype(np.float64), convw.astype(np.float64), window.astype(np.float64))
    y = ops.silu(y)
    kd = h * dk
    q = ops.l2norm(y[:, :kd].reshape(t, h, dk)) * dk ** -0.5
    k = ops.l2norm(y[:, kd : 2 * kd].reshape(t, h, dk))
    ref = np.concatenate([q.reshape(t, -1), k.reshape(t, -1), y[:, 2 * kd :]], axis=1)
    assert rel(qkvn.get(), ref) < 2e-5
    g = neg_a * ops.softplus(ab[:, hv:].astype(np.float64) + dt)
    beta = ops.sigmoid(ab[:, :hv].astype(np.float64))
    got = gb.get()
    assert rel(got[:, :hv], g) < 2e-6 and rel(got[:, hv:], beta) < 2e-6


def test_gdn_conv_commit_slides_window(cp, K):
    rng = np.random.default_rng(16)
    c, kw = 300, 4
    window = rng.standard_normal((2, kw - 1, c)).astype(np.float32)  # two layers
    raw = rng.standard_normal((2, 6, c)).astype(np.float32)
    for n in (1, 2, 5):
        win = cp.asarray(window)
        n_dev = cp.asarray(np.array([n], dtype=np.int32))
        K.gdn_conv_commit(win, (kw - 1) * c, cp.asarray(raw), c, 6 * c, c, kw, 2, n_dev=n_dev)
        for layer in range(2):
            hist = np.concatenate([window[layer], raw[layer, :n]])
            np.testing.assert_array_equal(win.get()[layer], hist[-(kw - 1):])


def gdn_inputs(rng, t, h, hv, dk, dv):
    q = ops.l2norm(rng.standard_normal((t, h, dk))) * dk ** -0.5
    k = ops.l2norm(rng.standard_normal((t, h, dk)))
    v = rng.standard_normal((t, hv, dv))
    g = -np.exp(rng.standard_normal((t, hv)) * 0.5) * 0.3
    beta = 1 / (1 + np.exp(-rng.standard_normal((t, hv))))
    qkvn = np.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=1).astype(np.float32)
    gb = np.concatenate([g, beta], axis=1).astype(np.float32)
    return q, k, v, g, beta, qkvn, gb


@pytest.mark.parametrize("dims", sorted(GDN_DIMS))
def test_gdn_step_verify_and_commit(cp, K, dims):
    d = GDN_DIMS[dims]
    h, hv, dk, dv = d["h"], d["hv"], d["dk"], d["dv"]
    rng = np.random.default_rng(17)
    t = 6
    q, k, v, g, beta, qkvn, gb = gdn_inputs(rng, t, h, hv, dk, dv)
    s0 = rng.standard_normal((hv, dk, dv)) * 0.3
    s_dev = cp.asarray(s0.transpose(0, 2, 1).astype(np.float32))  # K-last [HV][dv][dk]
    out = poisoned(cp, (t, hv * dv))
    # verify: outputs for all lanes, committed state untouched
    K.gdn_step(s_dev, 0, cp.asarray(qkvn), 0, cp.asarray(gb), 0, out, hv * dv, h, hv, dk, dv, t, emit=True,
               write_state=False)
    o_ref, s_ref, all_ref = ops.gdn_recurrent(q, k, v, g, beta, s0, return_all_states=True)
    assert rel(out.get(), o_ref.reshape(t, -1)) < 2e-5
    np.testing.assert_array_equal(s_dev.get(), s0.transpose(0, 2, 1).astype(np.float32))
    # decode path: one lane at a time, writing the state
    s_dec = cp.asarray(s0.transpose(0, 2, 1).astype(np.float32))
    dec_out = poisoned(cp, (t, hv * dv))
    for i in range(t):
        K.gdn_step(s_dec, 0, cp.asarray(qkvn[i : i + 1]), 0, cp.asarray(gb[i : i + 1]), 0, dec_out[i:], hv * dv, h, hv,
                   dk, dv, 1, emit=True, write_state=True)
        if i == 2:
            after3 = s_dec.get()
    np.testing.assert_array_equal(dec_out.get(), out.get())  # verify lanes == decode steps, bitwise
    assert rel(s_dec.get(), s_ref.transpose(0, 2, 1)) < 2e-5
    # commit n=3 from the recorded lanes == three decode steps, bitwise
    n_dev = cp.asarray(np.array([3], dtype=np.int32))
    K.gdn_step(s_dev, 0, cp.asarray(qkvn), 0, cp.asarray(gb), 0, None, 0, h, hv, dk, dv, t, n_dev=n_dev, emit=False,
               write_state=True)
    np.testing.assert_array_equal(s_dev.get(), after3)
    assert rel(after3, all_ref[2].transpose(0, 2, 1)) < 2e-5


# ---------------------------------------------------------------- attention
def test_qk_norm_rope_store(cp, K):
    rng = np.random.default_rng(18)
    t, nq, nkv, hd, rd, max_pos, pos0 = 3, 6, 2, 64, 16, 40, 7
    qg = rng.standard_normal((t, 2 * nq * hd)).astype(np.float32)
    kv = rng.standard_normal((t, 2 * nkv * hd)).astype(np.float32)
    qn, kn = (rng.standard_normal(hd) * 0.1).astype(np.float32), (rng.standard_normal(hd) * 0.1).astype(np.float32)
    inv = 1.0 / (1e7 ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
    qout = poisoned(cp, (t, nq * hd))
    kc, vc = poisoned(cp, (nkv, max_pos, hd)), poisoned(cp, (nkv, max_pos, hd))
    K.qk_norm_rope_store(cp.asarray(qg), 2 * nq * hd, cp.asarray(kv), 2 * nkv * hd, cp.asarray(qn), cp.asarray(kn), 1e-6,
                         nq, nkv, hd, rd, cp.asarray(inv), cp.asarray(np.array([pos0], np.int32)), qout, nq * hd, kc, vc,
                         False, max_pos, t)
    pos = np.arange(pos0, pos0 + t)
    cos, sin = ops.rope_cos_sin(pos, rd, 1e7)
    q = qg.reshape(t, nq, 2 * hd)[..., :hd].astype(np.float64)
    q_ref = ops.apply_rope(ops.rms_norm(q, qn, 1e-6), cos, sin)
    k_ref = ops.apply_rope(ops.rms_norm(kv[:, : nkv * hd].reshape(t, nkv, hd).astype(np.float64), kn, 1e-6), cos, sin)
    assert rel(qout.get().reshape(t, nq, hd), q_ref) < 2e-6
    assert rel(kc.get()[:, pos0 : pos0 + t].transpose(1, 0, 2), k_ref) < 2e-6
    np.testing.assert_array_equal(vc.get()[:, pos0 : pos0 + t].transpose(1, 0, 2), kv[:, nkv * hd :].reshape(t, nkv, hd))


def run_attention(cp, K, q, kcache, vcache, gate, pos0, kv_bf16, span=16):
    t, nq, hd = q.shape
    nkv, max_pos = kcache.shape[0], kcache.shape[1]
    if kv_bf16:
        kd, vd = cp.asarray(L.bf16_bits(kcache)), cp.asarray(L.bf16_bits(vcache))
    else:
        kd, vd = cp.asarray(kcache), cp.asarray(vcache)
    qg = np.zeros((t, nq, 2 * hd), np.float32)
    qg[..., hd:] = gate
    out = poisoned(cp, (t, nq * hd))
    part = cp.zeros(K.attention_partials_floats(t, nq, hd), dtype=cp.float32)
    K.attention(cp.asarray(q.reshape(t, -1)), nq * hd, kd, vd, kv_bf16, max_pos, nq, nkv, hd,
                cp.asarray(np.array([pos0], np.int32)), span, part, cp.asarray(qg.reshape(t, -1)), 2 * nq * hd, out,
                nq * hd, t)
    return out.get().reshape(t, nq, hd)


@pytest.mark.parametrize("hd,nq,nkv", [(32, 4, 1), (64, 4, 2), (256, 24, 4)])
@pytest.mark.parametrize("pos0", [0, 62, 64, 300, 4097])
@pytest.mark.parametrize("kv_bf16", [False, True])
def test_attention_matches_reference(cp, K, hd, nq, nkv, pos0, kv_bf16):
    rng = np.random.default_rng(pos0 + hd)
    t = 3
    max_pos = pos0 + t + 5
    q = rng.standard_normal((t, nq, hd)).astype(np.float32)
    kc = rng.standard_normal((nkv, max_pos, hd)).astype(np.float32)
    vc = rng.standard_normal((nkv, max_pos, hd)).astype(np.float32)
    gate = rng.standard_normal((t, nq, hd)).astype(np.float32)
    got = run_attention(cp, K, q, kc, vc, gate, pos0, kv_bf16)
    if kv_bf16:
        kc, vc = L.bf16_to_f32(L.bf16_bits(kc)), L.bf16_to_f32(L.bf16_bits(vc))
    keys = kc[:, : pos0 + t].transpose(1, 0, 2).astype(np.float64)
    vals = vc[:, : pos0 + t].transpose(1, 0, 2).astype(np.float64)
    ref = ops.attention(q.astype(np.float64), keys, vals, np.arange(pos0, pos0 + t), hd ** -0.5) * ops.sigmoid(
        gate.astype(np.float64))
    assert rel(got, ref) < 2e-5


def test_attention_lanes_are_width_invariant(cp, K):
    rng = np.random.default_rng(19)
    nq, nkv, hd, pos0 = 4, 2, 64, 700
    q = rng.standard_normal((16, nq, hd)).astype(np.float32)
    kc = rng.standard_normal((nkv, pos0 + 20, hd)).astype(np.float32)
    vc = rng.standard_normal((nkv, pos0 + 20, hd)).astype(np.float32)
    gate = rng.standard_normal((16, nq, hd)).astype(np.float32)
    full = run_attention(cp, K, q, kc, vc, gate, pos0, True)
    for w in (1, 2, 5, 9):
        part = run_attention(cp, K, q[:w], kc, vc, gate[:w], pos0, True)
        np.testing.assert_array_equal(part, full[:w])


# ---------------------------------------------------------------- argmax / sampling
def test_top2_argmax_margin_and_ties(cp, K):
    rng = np.random.default_rng(20)
    rows, v = 5, 248320
    x = rng.standard_normal((rows, v)).astype(np.float32)
    x[1, 1000] = x[1, 77] = 9.0  # exact tie: lowest index wins, margin 0
    x[2, :] = -1.0
    x[2, 5] = -0.5
    xd = cp.asarray(x)
    part = cp.zeros((rows, K.TOP2_BLOCKS, 2), dtype=cp.uint64)
    ids, top1, margin = cp.zeros(rows, cp.int32), poisoned(cp, rows), poisoned(cp, rows)
    K.top2(xd, v, v, rows, part, ids, top1, margin)
    srt = np.sort(x, axis=1)
    np.testing.assert_array_equal(ids.get(), np.argmax(x, axis=1))
    np.testing.assert_array_equal(top1.get(), srt[:, -1])
    np.testing.assert_array_equal(margin.get(), srt[:, -1] - srt[:, -2])


def test_gumbel_sampling_follows_softmax(cp, K):
    v, draws = 8, 4000
    logits = np.log(np.array([0.4, 0.2, 0.1, 0.1, 0.1, 0.05, 0.03, 0.02], dtype=np.float32))
    x = cp.asarray(np.tile(logits, (draws, 1)))
    part = cp.zeros((draws, K.TOP2_BLOCKS, 2), dtype=cp.uint64)
    ids, top1, margin = cp.zeros(draws, cp.int32), cp.zeros(draws, cp.float32), cp.zeros(draws, cp.float32)
    pos = cp.asarray(np.array([123], np.int32))
    K.top2(x, v, v, draws, part, ids, top1, margin, inv_temp=1.0, seed=42, pos0_dev=pos)
    got = np.bincount(ids.get(), minlength=v) / draws
    p = np.exp(logits) / np.exp(logits).sum()
    assert np.abs(got - p).max() < 0.035
    ids2 = cp.zeros(draws, cp.int32)
    K.top2(x, v, v, draws, part, ids2, top1, margin, inv_temp=1.0, seed=42, pos0_dev=pos)
    np.testing.assert_array_equal(ids.get(), ids2.get())  # keyed by (seed, position, index) only


def test_top2_does_not_depend_on_its_blocks(cp, K, monkeypatch):
    """The partial pass's blocks per row (TOP2_BLOCKS, 16 -> 32 in the thirteenth session) and its loads four ahead
    change which thread pushes which key, never the result: keys carry their ids, so argmax, top-1, margin and the
    Gumbel draws are the same bits for any partition (rows of the 27B's vocabulary, ties included)."""
    rng = np.random.default_rng(21)
    rows, v = 4, 248320
    x = rng.standard_normal((rows, v)).astype(np.float32)
    x[0, 5] = x[0, v - 1] = 7.5  # a tie across the row's ends
    xd = cp.asarray(x)
    pos = cp.asarray(np.array([77], np.int32))
    got = []
    for nb in (1, 7, 32):
        monkeypatch.setattr(K, "TOP2_BLOCKS", nb)
        for temp in (0.0, 0.7):
            part = cp.zeros((rows, nb, 2), dtype=cp.uint64)
            ids, top1, margin = cp.zeros(rows, cp.int32), poisoned(cp, rows), poisoned(cp, rows)
            K.top2(xd, v, v, rows, part, ids, top1, margin, inv_temp=1.0 / temp if temp else 0.0, seed=9, pos0_dev=pos)
            got.append((ids.get(), top1.get(), margin.get()))
    for a, b in zip(got[:2], got[2:4]):
        for u, w in zip(a, b):
            np.testing.assert_array_equal(u, w)
    for a, b in zip(got[:2], got[4:]):
        for u, w in zip(a, b):
            np.testing.assert_array_equal(u, w)
    assert got[0][0][0] == 5


@pytest.mark.parametrize("impl", ["v1", "a8"])
@pytest.mark.parametrize("fmt", [L.FMT_Q4, L.FMT_Q8, L.FMT_BF16])
def test_gemv_cluster_split_reduction_is_bitwise_the_ticket(cp, K, monkeypatch, impl, fmt):
    """sm_90: a split row group's CTAs as one thread-block cluster, partials summed through DSMEM in
    split order, must give the ticket path's bits (same additions, same order) for every split
    count a cluster takes, every epilogue mode, and 1 / 8 / 16 lanes. Elsewhere both runs take
    the ticket path (the cluster count is 1) and the test still checks repeatability."""
    from q27py.gpu import constants as C
    from q27py.gpu.runtime import Runtime

    rng = np.random.default_rng(41)
    cols = 4096  # 64 chunks
    w = rng.standard_normal((300, cols)).astype(np.float32) * 0.05
    gu = L.interleave_gate_up(w[:150], w[150:])
    m_store = K.upload_packed(L.pack_matrix(w, fmt))
    m_add = K.upload_packed(L.pack_matrix(w, fmt), mode=K.MODE_ADD)
    m_glu = K.upload_packed(L.pack_matrix(gu, fmt), mode=K.MODE_SWIGLU, out_rows=150)
    x = padded_x(cp, rng.standard_normal((16, cols)).astype(np.float32), cols)
    sm90 = Runtime.get().cc >= (9, 0)
    for splits in (2, 3, 5, 8):
        for n in (1, 8, 16):
            got = {}
            for cmax in (0, 8):
                monkeypatch.setattr(C, "GEMV_CLUSTER_MAX", cmax)
                outs = []
                for m, width in ((m_store, 300), (m_add, 300), (m_glu, 150)):
                    y = cp.asarray(np.full((n, width), 0.25, np.float32)) if m.mode == K.MODE_ADD else poisoned(cp, (n, width))
                    plan = K.GemvPlan([m], [(y, width)], K.Workspace(), impl=impl, partition=(1, splits))
                    assert plan.clusters == [splits if (cmax and sm90) else 1]
                    plan.run(x, cols, n)
                    outs.append(y.get())
                got[cmax] = outs
            for a, b in zip(got[0], got[8]):
                assert np.isfinite(a).all()
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("impl", ["a8", "v1"])
@pytest.mark.parametrize("fmt", [L.FMT_Q4, L.FMT_BF16])
@pytest.mark.parametrize("mode", ["store", "add", "swiglu"])
def test_gemv_tail_split_matches_float64(cp, K, impl, fmt, mode, monkeypatch):
    """A matrix whose row groups overrun the resident CTAs by a thin last wave runs that tail as a
    K-split second descriptor row (kernels.tail_split): every row, the tail's included, still
    matches float64, in each epilogue, with the outputs and scales offset to the tail's rows."""
    from q27py.gpu import constants as C
    from q27py.gpu.runtime import Runtime

    monkeypatch.setattr(C, "GEMV_TAIL_SPLIT", 1)  # off by default (measured slower): the path stays right
    # a8 q4 on a gemv_wg card: the tail split is sized for its slots (GEMV_TAIL_CTAS per SM) and on by default
    ctas = K.split_ctas_per_sm(impl, fmt, tail=True)
    sms = Runtime.get().sm_count
    slots = ctas * sms if ctas else K.gemv_slots(sms)
    rng = np.random.default_rng(40 + fmt)
    cols, tail = 1024, 5
    rows_w = (slots + tail) * 64  # packed rows: tail row groups past the slots
    if mode == "swiglu":
        inter = rows_w // 2 - 3  # ragged: the last tile's outputs are partly past nout
        w = L.interleave_gate_up(rng.standard_normal((inter, cols)).astype(np.float32) * 0.05,
                                 rng.standard_normal((inter, cols)).astype(np.float32) * 0.05)
        pm = L.pack_matrix(w, fmt)
        m = K.upload_packed(pm, mode=K.MODE_SWIGLU, out_rows=inter)
        nout = inter
    else:
        pm = L.pack_matrix(rng.standard_normal((rows_w - 7, cols)).astype(np.float32) * 0.05, fmt)
        m = K.upload_packed(pm, mode=K.MODE_ADD if mode == "add" else K.MODE_STORE)
        nout = rows_w - 7
    pieces = K.tail_split(m.row_groups, m.shape.kchunks, 1, sms, ctas)
    assert len(pieces) == 2 and pieces[1][1] == tail and pieces[1][2] >= 2, pieces
    wd = L.unpack(pm).astype(np.float64)
    for n in (1, 9, 16):
        x = rng.standard_normal((n, cols)).astype(np.float32)
        base = rng.standard_normal((n, nout)).astype(np.float32)
        y = cp.asarray(base) if mode == "add" else poisoned(cp, (n, nout))
        plan = K.GemvPlan([m], [(y, nout)], K.Workspace(), impl=impl)
        assert sum(d.shape[0] for _, d, _ in plan.desc_host) == 2, "the tail is its own descriptor row"
        plan.run(padded_x(cp, x, pm.shape.kpad), pm.shape.kpad, n)
        got = y.get()
        assert np.isfinite(got).all(), f"unwritten outputs at n={n}"
        ref = quantized_x(x, fmt, impl).astype(np.float64) @ wd.T
        if mode == "swiglu":
            tiles = ref.reshape(n, -1, 2, 8)
            g, u = tiles[:, :, 0, :].reshape(n, -1)[:, :nout], tiles[:, :, 1, :].reshape(n, -1)[:, :nout]
            ref = ops.silu(g) * u
        elif mode == "add":
            ref = base + ref
        assert rel(got, ref) < 2e-5, (n, rel(got, ref))
        t0 = (nout // 64 - tail) * 64 if mode != "swiglu" else (m.row_groups - tail) * 32
        assert rel(got[:, t0:], ref[:, t0:]) < 2e-5, "the tail rows"
