"""cuda/kv_rotated.cu (k5v3 / k3v3 kernels, not yet wired into FastModel) against the numpy spec.

The quantizer's row norm is a block reduction (another summation order than numpy's pairwise sum),
so a coordinate that lies on a codebook edge to the last bit may take the neighbouring code:
codes must agree on >= 99.9 % of coordinates and the dequantized rows within 1e-3 relative.
"""

from __future__ import annotations

import numpy as np
import pytest

from q27py.model import kvformat as F
from q27py.model import ops

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu.runtime import Runtime

    Runtime.get().module("kv_rotated")
    return cupy


@pytest.fixture(scope="module")
def K(cp):
    from q27py.gpu import kernels

    return kernels


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def gpu_quantize(cp, K, x: np.ndarray, bits: int):
    n, d = x.shape
    c, e = K.rotated_kv_tables(bits)
    codes = cp.zeros((n, d * bits // 8), cp.uint8)
    norms = cp.zeros(n, cp.uint16)
    K.lm_quantize_rows(cp.asarray(x), d, n, d, bits, c, e, codes, norms)
    return codes.get(), norms.get().view(np.float16)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("bits", [3, 5])
def test_quantizer_matches_spec(cp, K, d, bits):
    rng = np.random.default_rng(d + bits)
    x = rng.standard_normal((300, d)).astype(np.float32)
    x[:, :3] *= 10
    codes, norms = gpu_quantize(cp, K, x, bits)
    want_codes, want_norms = F.lm_quantize(x, bits)
    got_c, want_c = F.unpack_codes(codes, bits, d), F.unpack_codes(want_codes, bits, d)
    assert np.mean(got_c == want_c) >= 0.999
    np.testing.assert_allclose(norms.astype(np.float32), want_norms.astype(np.float32), rtol=2e-3)
    assert rel(F.lm_dequantize(codes, norms, bits, d), F.lm_dequantize(want_codes, want_norms, bits, d)) < 1e-3


@pytest.mark.parametrize("inverse", [False, True])
def test_rotate_heads(cp, K, inverse):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 3 * 128 + 16)).astype(np.float32)
    xd = cp.asarray(x)
    K.rotate_heads(xd, x.shape[1], 5, 3, 128, inverse)
    got = xd.get()
    f = F.unrotate if inverse else F.rotate
    np.testing.assert_allclose(got[:, : 3 * 128], f(x[:, : 3 * 128].reshape(5, 3, 128)).reshape(5, -1), atol=1e-5)
    np.testing.assert_array_equal(got[:, 3 * 128 :], x[:, 3 * 128 :])


@pytest.mark.parametrize("fmt", ["k5v3", "k3v3"])
@pytest.mark.parametrize("t,pos0,hd,nq,nkv", [(1, 0, 64, 4, 2), (1, 2047, 256, 24, 4), (16, 300, 128, 8, 2)])
def test_split_attention_over_rotated_codes(cp, K, fmt, t, pos0, hd, nq, nkv):
    f = F.get_format(fmt)
    rng = np.random.default_rng(t + pos0 + hd)
    max_pos = pos0 + t + 5
    k = (rng.standard_normal((nkv, max_pos, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((nkv, max_pos, hd)).astype(np.float32)
    kc, kn = F.lm_quantize(k, f.k_bits)
    vc, vn = F.lm_quantize(v, f.v_bits)
    kd, vd = F.lm_dequantize(kc, kn, f.k_bits, hd), F.lm_dequantize(vc, vn, f.v_bits, hd)
    ldq, ldqg, ldo = nq * hd + 32, 2 * nq * hd + 8, nq * hd + 64
    q = rng.standard_normal((t, ldq)).astype(np.float32)
    qg = rng.standard_normal((t, ldqg)).astype(np.float32)
    qd = cp.asarray(q)
    K.rotate_heads(qd, ldq, t, nq, hd, False)
    out = cp.full((t, ldo), np.nan, cp.float32)
    part = cp.zeros(K.attention_partials_floats(t, nq, hd), dtype=cp.float32)
    K.attention_rotated(qd, ldq, cp.asarray(kc), cp.asarray(vc), cp.asarray(kn.view(np.uint16)),
                        cp.asarray(vn.view(np.uint16)), f.k_bits, f.v_bits, K.rotated_kv_tables(f.k_bits)[0],
                        K.rotated_kv_tables(f.v_bits)[0], max_pos, nq, nkv, hd, cp.asarray(np.array([pos0], np.int32)),
                        max(16, t), part, cp.asarray(qg), ldqg, out, ldo, t)
    got = out.get()
    assert np.isnan(got[:, nq * hd :]).all()
    got = got[:, : nq * hd].reshape(t, nq, hd)
    rep, s = nq // nkv, pos0 + t
    qh = q[:, : nq * hd].reshape(t, nq, hd).astype(np.float64)
    gate = qg[:, : 2 * nq * hd].reshape(t, nq, 2 * hd)[..., hd:].astype(np.float64)
    want = np.empty((t, nq, hd))
    for g in range(nkv):
        heads = slice(g * rep, (g + 1) * rep)
        want[:, heads] = ops.attention(qh[:, heads], kd[g : g + 1, :s].transpose(1, 0, 2).astype(np.float64),
                                       vd[g : g + 1, :s].transpose(1, 0, 2).astype(np.float64),
                                       np.arange(pos0, s), hd ** -0.5)
    want *= ops.sigmoid(gate)
    assert rel(got, want) < 1e-4
