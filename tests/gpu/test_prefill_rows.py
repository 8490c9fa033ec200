"""Prefill-chunk forms of the norm, conv, RoPE and SwiGLU kernels (cuda/norm.cu rmsnorm_rows_wide /
gated_rmsnorm_rows, cuda/conv.cu gdn_conv_rows_k4, cuda/rope.cu qk_norm_rope_store_rows_d*,
cuda/dequant.cu swiglu_tiles_bf16) and the bf16
rows their producers write for the cuBLAS route (GemvPlan.gemm_inputs / swiglu_bf16).

Each prefill form is held BITWISE to the kernel it replaces on prefill chunks (same products, same
reduction tree), and each bf16 output to the bytes blas.to_bf16 makes of that kernel's fp32 rows, so
the forward's outputs do not move: the last test runs a cuBLAS-route prefill both ways.
"""

from __future__ import annotations

import numpy as np
import pytest

from q27py.gpu import layout as L

gpu = pytest.mark.gpu  # every test but the last (launch arguments, CPU)


@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu.runtime import Runtime

    for mod in ("norm", "conv", "dequant", "rope"):
        Runtime.get().module(mod)
    return cupy


@pytest.fixture(scope="module")
def K(cp):
    from q27py.gpu import kernels

    return kernels


def poisoned(cp, shape, dtype=None):
    import cupy

    if dtype == cupy.uint16:
        return cupy.full(shape, 0x7FC1, dtype=cupy.uint16)  # a NaN pattern no conversion makes
    return cupy.full(shape, np.nan, dtype=cupy.float32)


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


@gpu
@pytest.mark.parametrize("hidden", [96, 300, 1500, 2048, 5120, 9000])
def test_rmsnorm_rows_is_bitwise_rmsnorm(cp, K, hidden):
    """Every row length the model family uses and the edges of the emulated block: 256-thread rows
    (< 2048), 1024-thread rows, and past NORM_PER_THREAD x 1024 (the remainder loop)."""
    rng = np.random.default_rng(hidden)
    t, ld = 37, L.round_up(hidden, 64) + 64
    x = cp.asarray((rng.standard_normal((t, ld)) * rng.uniform(0.1, 30, (t, 1))).astype(np.float32))
    w = cp.asarray((rng.standard_normal(hidden) * 0.2).astype(np.float32))
    for add_one in (True, False):
        want = poisoned(cp, (t, ld))
        K.rmsnorm(x, ld, w, 1e-6, hidden, want, ld, t, add_one=add_one)
        got, gotb = poisoned(cp, (t, ld)), poisoned(cp, (t, ld), cp.uint16)
        K.rmsnorm_rows(x, ld, w, 1e-6, hidden, got, ld, t, gotb, ld, add_one=add_one)
        np.testing.assert_array_equal(bits(got.get()[:, :hidden]), bits(want.get()[:, :hidden]))
        np.testing.assert_array_equal(gotb.get()[:, :hidden], L.bf16_bits(want.get()[:, :hidden]))
        assert np.isnan(got.get()[:, hidden:]).all(), "wrote past the row"
        only_b = poisoned(cp, (t, ld), cp.uint16)
        untouched = poisoned(cp, (t, ld))
        K.rmsnorm_rows(x, ld, w, 1e-6, hidden, None, ld, t, only_b, ld, add_one=add_one)
        np.testing.assert_array_equal(only_b.get(), gotb.get())
        K.rmsnorm_rows(x, ld, w, 1e-6, hidden, untouched, ld, t, None, 0, add_one=add_one)
        np.testing.assert_array_equal(bits(untouched.get()[:, :hidden]), bits(want.get()[:, :hidden]))


@gpu
@pytest.mark.parametrize("hv,dv,t", [(6, 64, 37), (48, 128, 70), (4, 100, 16), (3, 32, 1)])
def test_gated_rmsnorm_rows_is_bitwise_gated_rmsnorm(cp, K, hv, dv, t):
    rng = np.random.default_rng(hv * dv + t)
    o = cp.asarray(rng.standard_normal((t, hv * dv + 8)).astype(np.float32) * 2)
    z = cp.asarray(rng.standard_normal((t, hv * dv + 20)).astype(np.float32))
    w = cp.asarray((1 + 0.1 * rng.standard_normal(dv)).astype(np.float32))
    ld = hv * dv + 16
    want = poisoned(cp, (t, ld))
    K.gated_rmsnorm(o, hv * dv + 8, z, hv * dv + 20, w, 1e-6, t, hv, dv, want, ld)
    got, gotb = poisoned(cp, (t, ld)), poisoned(cp, (t, ld), cp.uint16)
    K.gated_rmsnorm_rows(o, hv * dv + 8, z, hv * dv + 20, w, 1e-6, t, hv, dv, got, ld, gotb, ld)
    n = hv * dv
    np.testing.assert_array_equal(bits(got.get()[:, :n]), bits(want.get()[:, :n]))
    np.testing.assert_array_equal(gotb.get()[:, :n], L.bf16_bits(want.get()[:, :n]))
    assert np.isnan(got.get()[:, n:]).all()
    only_b = poisoned(cp, (t, ld), cp.uint16)
    K.gated_rmsnorm_rows(o, hv * dv + 8, z, hv * dv + 20, w, 1e-6, t, hv, dv, None, ld, only_b, ld)
    np.testing.assert_array_equal(only_b.get(), gotb.get())


GDN_DIMS = {"tiny": dict(h=4, hv=8, dk=16, dv=8), "small": dict(h=2, hv=6, dk=64, dv=64),
            "uneven": dict(h=2, hv=3, dk=32, dv=96), "27b": dict(h=16, hv=48, dk=128, dv=128)}


@gpu
@pytest.mark.parametrize("kw", [4, 3])
@pytest.mark.parametrize("t", [1, 77, 160])
@pytest.mark.parametrize("dims", sorted(GDN_DIMS))
def test_gdn_conv_rows_is_bitwise_gdn_conv(cp, K, dims, t, kw):
    """Ragged token counts (a partial last block, one token), the window taps of the first block, the
    gates; kw = 3 takes gdn_conv itself (the rows form is built for the family's 4 taps)."""
    d = GDN_DIMS[dims]
    h, hv, dk, dv = d["h"], d["hv"], d["dk"], d["dv"]
    rng = np.random.default_rng(t * 7 + kw)
    c = 2 * h * dk + hv * dv
    ldr = c + 12
    raw = cp.asarray(rng.standard_normal((t, ldr)).astype(np.float32))
    window = cp.asarray(rng.standard_normal((kw - 1, c)).astype(np.float32))
    convw = cp.asarray((rng.standard_normal((c, kw)) * 0.5).astype(np.float32))
    ab = cp.asarray(rng.standard_normal((t, 2 * hv + 2)).astype(np.float32))
    neg_a = cp.asarray((-np.exp(rng.standard_normal(hv) * 0.5)).astype(np.float32))
    dt = cp.asarray(rng.standard_normal(hv).astype(np.float32))
    outs = []
    for conv in (K.gdn_conv, K.gdn_conv_rows):
        qkvn, gb = poisoned(cp, (t, c)), poisoned(cp, (t, 2 * hv))
        conv(raw, ldr, window, convw, ab, 2 * hv + 2, neg_a, dt, h, hv, dk, dv, kw, qkvn, gb, t)
        outs.append((qkvn.get(), gb.get()))
    (q0, g0), (q1, g1) = outs
    assert not np.isnan(q0).any() and not np.isnan(g0).any()
    np.testing.assert_array_equal(bits(q1), bits(q0))
    np.testing.assert_array_equal(bits(g1), bits(g0))


def swiglu_case(K, fmt, seed):
    """One SwiGLU matrix (300 interleaved gate / up rows x 640) packed in fmt and uploaded, and 200 tokens of
    activations (host, kpad wide): (rng, rows, cols, ntok, packed, uploaded, x). Also test_gate_up_bf16_gpu's."""
    rng = np.random.default_rng(seed)
    rows, cols, ntok = 300, 640, 200
    w = L.interleave_gate_up(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05,
                             rng.standard_normal((rows, cols)).astype(np.float32) * 0.05)
    pm = L.pack_matrix(w, fmt)
    m = K.upload_packed(pm, mode=K.MODE_SWIGLU, out_rows=rows)
    x = np.zeros((ntok, pm.shape.kpad), np.float32)
    x[:, :cols] = rng.standard_normal((ntok, cols))
    return rng, rows, cols, ntok, pm, m, x


@gpu
@pytest.mark.parametrize("fmt", [L.FMT_Q8, L.FMT_Q4])
def test_swiglu_bf16_rows_are_the_converted_fp32_rows(cp, K, fmt):
    """A SwiGLU plan on cuBLAS's bf16 route writing bf16 rows (run(y_bf16=...)) gives the bytes of
    its fp32 rows converted; and a plan fed producer-written bf16 rows (run(x_bf16=...)) gives the
    fp32 outputs of the plan converting x itself, for one and for two matrices."""
    from q27py.gpu import blas

    rng, rows, cols, ntok, pm, m, x = swiglu_case(K, fmt, 80 + fmt)
    assert ntok >= blas.MIN_TOKENS
    kpad = pm.shape.kpad
    xd = cp.asarray(x)
    y = poisoned(cp, (ntok, rows))
    plan = K.GemvPlan([m], [(y, rows)], K.Workspace())
    assert plan.swiglu_bf16(ntok) and plan.gemm_inputs(ntok) == (True, False)
    assert not plan.swiglu_bf16(blas.MIN_TOKENS - 1) and plan.gemm_inputs(blas.MIN_TOKENS - 1) == (False, True)
    plan.run(xd, kpad, ntok)
    want = y.get()
    yb = poisoned(cp, (ntok, L.round_up(rows, 64)), cp.uint16)
    xb = cp.asarray(L.bf16_bits(x))
    y2 = poisoned(cp, (ntok, rows))
    plan2 = K.GemvPlan([m], [(y2, rows)], K.Workspace())
    plan2.run(xd, kpad, ntok, x_bf16=xb, y_bf16=yb)
    np.testing.assert_array_equal(yb.get()[:, :rows], L.bf16_bits(want))
    assert np.isnan(y2.get()).all(), "the fp32 rows were written as well"
    # two matrices sharing x: one conversion for both, or the producer's rows
    a = K.upload_packed(L.pack_matrix(rng.standard_normal((130, cols)).astype(np.float32) * 0.05, fmt))
    b = K.upload_packed(L.pack_matrix(rng.standard_normal((70, cols)).astype(np.float32) * 0.05, fmt))
    res = []
    for xbf in (None, xb):
        ya, yb2 = poisoned(cp, (ntok, 130)), poisoned(cp, (ntok, 70))
        K.GemvPlan([a, b], [(ya, 130), (yb2, 70)], K.Workspace()).run(xd, kpad, ntok, x_bf16=xbf)
        res.append((ya.get(), yb2.get()))
    for u, v in zip(res[0], res[1]):
        assert not np.isnan(u).any()
        np.testing.assert_array_equal(bits(u), bits(v))


@gpu
def test_prefill_forward_is_bitwise_the_converting_route(cp, K, monkeypatch):
    """A q4s prefill chunk on the cuBLAS route (>= blas.MIN_TOKENS tokens): with the producers writing
    bf16 rows, the rows kernels and the GDN output norm inside the chunked2 output pass (the shipped
    forward) every output -- logits, hidden rows, the
    GDN state and conv window, the KV rows, the MTP head's logits -- equals the forward with the old
    kernels and the plans converting fp32 rows, bit for bit."""
    from q27py import DEFAULT_MODEL_DIR
    from q27py.gpu import blas
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    weights = from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), "q4s", progress=False)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, weights.cfg.vocab_size, 300)
    assert len(ids) >= blas.MIN_TOKENS

    def run():
        model = FastModel(weights, max_context=512, kv_dtype="bf16", chunk=512)
        st = model.new_state()
        out = model.forward(st, ids, logits_rows=np.arange(0, len(ids), 37))
        got = {"logits": out.logits.copy(), "hidden": np.asarray(out.hidden).copy()}
        if model.has_mtp:  # the MTP warm-up's prefill-sized call, with logits rows to compare
            lg, hm = model.mtp_forward(st.mtp_kv, got["hidden"], list(ids[1:]) + [0], 0,
                                       logits_rows=np.arange(0, len(ids), 41))
            got.update({"mtp_logits": lg, "mtp_hidden": hm})
        got.update({k: np.asarray(v) for k, v in model.export_prefix(st).items()})
        return got

    new = run()
    # the old route: fp32 rows everywhere (plans convert), the one-row kernels
    monkeypatch.setattr(FastModel, "_bf16_rows", lambda self, plan, t, buf: None)
    monkeypatch.setattr(K, "rmsnorm_rows", lambda x, ldx, w, eps, hidden, y, ldy, n, yb=None, ldyb=0, add_one=True:
                        K.rmsnorm(x, ldx, w, eps, hidden, y, ldy, n, add_one=add_one))
    monkeypatch.setattr(K, "gated_rmsnorm_rows", lambda o, ldo, z, ldz, w, eps, n, hv, dv, y, ldy, yb=None, ldyb=0:
                        K.gated_rmsnorm(o, ldo, z, ldz, w, eps, n, hv, dv, y, ldy))
    monkeypatch.setattr(K, "gdn_conv_rows", K.gdn_conv)
    monkeypatch.setattr(K, "GDN2_OUT_GATED", False)  # the output norm as its own kernel after the output pass
    old = run()
    assert new.keys() == old.keys()
    for k in new:
        a, b = np.asarray(new[k]), np.asarray(old[k])
        assert a.dtype == b.dtype and a.shape == b.shape, k
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=k)


@gpu
@pytest.mark.parametrize("hd,rd,nq,nkv", [(256, 64, 24, 4), (128, 128, 4, 2), (64, 64, 3, 1), (256, 128, 6, 2)])
@pytest.mark.parametrize("t,pos0", [(64, 0), (301, 250_000)])
@pytest.mark.parametrize("kv_bf16", [False, True])
def test_rope_rows_is_bitwise_the_block_form(cp, K, monkeypatch, hd, rd, nq, nkv, t, pos0, kv_bf16):
    """qk_norm_rope_store's warp-per-head form (prefill chunks) writes the block form's q rows and K / V cache rows
    bit for bit: the 27B's heads (256, partial rotation 64), a whole-head rotation, the smallest head, a rotation
    spanning two lanes' dims; row scales over three decades; a position near the model's maximum (large angles)."""
    rng = np.random.default_rng(hd + rd + t)
    max_pos = pos0 + t + 5
    scale = rng.uniform(0.01, 30, (t, 1)).astype(np.float32)
    qg = cp.asarray((rng.standard_normal((t, 2 * nq * hd)) * scale).astype(np.float32))
    kv = cp.asarray((rng.standard_normal((t, 2 * nkv * hd)) * scale).astype(np.float32))
    qn, kn = (cp.asarray((rng.standard_normal(hd) * 0.1).astype(np.float32)) for _ in range(2))
    inv = cp.asarray(1.0 / (1e7 ** (np.arange(0, rd, 2, dtype=np.float64) / rd)))
    pos = cp.asarray(np.array([pos0], np.int32))
    dt = cp.uint16 if kv_bf16 else None

    def run():
        qout = poisoned(cp, (t, nq * hd))
        kc, vc = poisoned(cp, (nkv, max_pos, hd), dt), poisoned(cp, (nkv, max_pos, hd), dt)
        K.qk_norm_rope_store(qg, 2 * nq * hd, kv, 2 * nkv * hd, qn, kn, 1e-6, nq, nkv, hd, rd, inv, pos, qout, nq * hd,
                             kc, vc, kv_bf16, max_pos, t)
        return qout.get(), kc.get(), vc.get()

    assert K.rope_rows_fits(hd, rd, t)
    new = run()
    monkeypatch.setattr(K, "ROPE_ROWS_MIN", 1 << 30)
    old = run()
    for a, b, name in zip(new, old, ("q", "k cache", "v cache")):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
    assert not np.isnan(new[0]).any()


# ---------------------------------------------------------------- CPU checks (no GPU): the launches
def test_wrappers_launch_their_kernels_with_every_parameter(monkeypatch):
    """Each wrapper's argument tuple has as many entries as its kernel has parameters (cuda/ sources
    parsed), and the grids cover the rows: ceil(T / GATED_ROWS) and ceil(T / CONV_ROWS) blocks."""
    from q27py.gpu import blas
    from q27py.gpu import constants as C
    from q27py.gpu import kernels as K
    from tests.gpu.test_decode_batch_layout import _params, _Recorder

    rec = _Recorder()
    monkeypatch.setattr(K.Runtime, "get", staticmethod(lambda: rec))
    monkeypatch.setattr(blas.Runtime, "get", staticmethod(lambda: rec))
    x = object()
    K.rmsnorm_rows(x, 5120, x, 1e-6, 5120, x, 5120, 4096, x, 5120)
    K.rmsnorm_rows(x, 300, x, 1e-6, 300, None, 300, 37, x, 320, add_one=False)
    K.gated_rmsnorm_rows(x, 6144, x, 16400, x, 1e-6, 4096, 48, 128, None, 6144, x, 6144)
    K.gdn_conv_rows(x, 16400, x, x, x, 96, x, x, 16, 48, 128, 128, 4, x, x, 4096)
    K.gdn_conv_rows(x, 16400, x, x, x, 96, x, x, 16, 48, 128, 128, 3, x, x, 4096)  # falls back to gdn_conv
    m = type("M", (), {"mode": C.MODE_SWIGLU, "nout": 17408,
                       "shape": type("S", (), {"row_tiles": 2176, "kpad": 5120})()})()
    monkeypatch.setattr(blas, "gemm_bf16", lambda *a, **k: None)
    monkeypatch.setattr(blas, "_SCRATCH", blas._Scratch())  # host scratch, never the process's device one
    rec.cp = np
    yb = np.zeros((3, 17408), np.uint16)
    blas._gemm_expanded(m, x, x, 3, x, 17408, y_bf16=yb)
    names = [c.kernel for c in rec.calls]
    assert names == ["rmsnorm_rows_wide", "rmsnorm_rows_wide", "gated_rmsnorm_rows", "gdn_conv_rows_k4", "gdn_conv",
                     "swiglu_tiles_bf16"]
    for c in rec.calls:
        assert len(c.args) == _params(c.module, c.kernel), c.kernel
    assert rec.calls[0].args[6] == 1024 and rec.calls[1].args[6] == 256  # the block the one-row kernel takes
    assert rec.calls[1].args[7] is None  # no fp32 rows asked
    assert rec.calls[2].grid == (-(-4096 // C.GATED_ROWS), 48) and rec.calls[2].block == 128
    assert rec.calls[3].grid == (-(-4096 // C.CONV_ROWS), 80) and rec.calls[3].block == 128
    assert rec.calls[5].grid == (34, 3) and rec.calls[5].args[-1] == 17408


def test_rope_rows_launch_and_fallbacks(monkeypatch):
    """qk_norm_rope_store takes the warp-per-head form on prefill chunks of the heads it fits (every kernel
    parameter passed, 4 heads a block) and the block form for decode-sized launches and other head shapes."""
    from q27py.gpu import kernels as K
    from tests.gpu.test_decode_batch_layout import _params, _Recorder

    rec = _Recorder()
    monkeypatch.setattr(K.Runtime, "get", staticmethod(lambda: rec))
    x = object()
    args = (x, 12288, x, 2048, x, x, 1e-6, 24, 4)
    K.qk_norm_rope_store(*args, 256, 64, x, x, x, 6144, x, x, True, 8192, 4096)
    K.qk_norm_rope_store(*args, 256, 64, x, x, x, 6144, x, x, True, 8192, 16)  # a verify span
    K.qk_norm_rope_store(*args, 32, 8, x, x, x, 768, x, x, False, 512, 300)  # the rotation within a lane: block form
    K.qk_norm_rope_store(*args, 128, 32, x, x, x, 3072, x, x, False, 512, 300)
    assert [c.kernel for c in rec.calls] == ["qk_norm_rope_store_rows_d8", "qk_norm_rope_store", "qk_norm_rope_store",
                                             "qk_norm_rope_store"]
    for c in rec.calls:
        assert len(c.args) == _params(c.module, c.kernel), c.kernel
    assert rec.calls[0].grid == (4096, 7) and rec.calls[0].block == 128
    assert rec.calls[1].grid == (16, 28) and rec.calls[1].block == 256
    assert K.rope_rows_fits(64, 64, 64) and not K.rope_rows_fits(64, 64, 63) and not K.rope_rows_fits(96, 64, 512)
