"""The numpy KV format specification (q27py/model/kvformat.py): exact e4m3 rounding, scales,
rotation, Lloyd-Max codebooks, bit planes, round-trip error bounds and byte counts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from q27py.model import kvformat as F

FINITE = np.array([c for c in range(256) if (c & 0x7F) != 0x7F])


def nearest_e4m3_bruteforce(x: np.ndarray) -> np.ndarray:
    """Nearest finite e4m3 value by exhaustive search; ties to the even code; beyond 448 saturates."""
    vals = F.E4M3_VALUES[FINITE].astype(np.float64)
    out = np.empty(x.shape, dtype=np.float64)
    for i, v in enumerate(x.astype(np.float64).ravel()):
        dist = np.abs(vals - v)
        best = np.flatnonzero(dist == dist.min())
        codes = FINITE[best]
        if len(codes) > 1:  # a tie (or +-0): the even mantissa wins, and +0 over -0
            even = [c for c in codes if (c & 1) == 0 and not (vals[list(FINITE).index(c)] == 0 and c & 0x80)]
            codes = even or codes
        out.flat[i] = F.E4M3_VALUES[codes[0]]
    return np.clip(out, -448, 448)


def test_e4m3_table_known_values():
    assert F.E4M3_VALUES[0x7E] == 448.0 and F.E4M3_VALUES[0x01] == 2.0 ** -9
    assert F.E4M3_VALUES[0x08] == 2.0 ** -6 and F.E4M3_VALUES[0x38] == 1.0
    assert np.isnan(F.E4M3_VALUES[0x7F]) and np.isnan(F.E4M3_VALUES[0xFF])


def test_e4m3_every_code_round_trips():
    vals = F.E4M3_VALUES[FINITE]
    codes = F.e4m3_encode(vals)
    # -0 encodes as 0x80, everything else back to its own code
    np.testing.assert_array_equal(codes, FINITE.astype(np.uint8))


def test_e4m3_rounding_matches_exhaustive_search():
    rng = np.random.default_rng(0)
    vals = F.E4M3_VALUES[FINITE].astype(np.float64)
    pos = np.unique(vals[vals >= 0])
    mids = (pos[1:] + pos[:-1]) / 2  # exact ties: round-half-even decides
    x = np.concatenate([
        mids, -mids, mids * (1 + 1e-6), mids * (1 - 1e-6),
        rng.standard_normal(3000) * np.exp2(rng.integers(-12, 10, 3000)),
        [449.0, 463.9, 464.0, 500.0, 1e6, -1e6, 2.0 ** -11, -(2.0 ** -10)],
    ]).astype(np.float32)
    got = F.e4m3_decode(F.e4m3_encode(x)).astype(np.float64)
    np.testing.assert_array_equal(got, nearest_e4m3_bruteforce(x))


def test_e4m3_ties_go_to_even_mantissa():
    # 1.0625 lies halfway between 1.0 (mantissa 000) and 1.125 (001); 1.1875 between 1.125 and 1.25 (010)
    assert F.e4m3_decode(F.e4m3_encode(np.float32([1.0625, 1.1875, -1.0625]))).tolist() == [1.0, 1.25, -1.0]


def test_e4m3_saturates_and_nan():
    codes = F.e4m3_encode(np.float32([1e30, -np.inf, np.inf, np.nan]))
    assert codes.tolist() == [0x7E, 0xFE, 0x7E, 0x7F]


def test_fp8_row_scale_is_power_of_two_that_puts_amax_in_128_256():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((50, 4, 64)) * np.exp2(rng.integers(-20, 20, (50, 4, 1)))).astype(np.float32)
    codes, e = F.fp8_quantize(x)
    amax = np.abs(x).max(-1) * np.exp2(-e.astype(np.float64))
    assert np.all((amax >= 128) & (amax < 256))
    # never saturates, and the only error is e4m3 rounding: relative <= 2^-4 above the subnormal range
    y = F.fp8_dequantize(codes, e)
    big = np.abs(x) * np.exp2(-e.astype(np.float64))[..., None] >= 2.0 ** -6
    rel = np.abs(y - x)[big] / np.abs(x)[big]
    assert rel.max() <= 2.0 ** -4 + 1e-7
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0 ** -4 + np.exp2(e.astype(np.float64) - 10)[..., None])


def test_fp8_zero_row_and_determinism():
    x = np.zeros((3, 2, 8), np.float32)
    codes, e = F.fp8_quantize(x)
    assert not codes.any() and not e.any()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((7, 2, 32)).astype(np.float32)
    a, b = F.fp8_quantize(x), F.fp8_quantize(x.copy())
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def sylvester(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize("d", [8, 64, 256])
def test_rotation_is_the_signed_hadamard_and_orthonormal(d):
    rng = np.random.default_rng(d)
    x = rng.standard_normal((5, d)).astype(np.float32)
    expect = (x * F.rotation_signs(d)) @ sylvester(d).T / math.sqrt(d)
    np.testing.assert_allclose(F.rotate(x), expect, rtol=0, atol=1e-5)
    np.testing.assert_allclose(F.unrotate(F.rotate(x)), x, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(F.rotate(x), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_rotation_signs_are_mixed():
    s = F.rotation_signs(256)
    assert set(np.unique(s).tolist()) == {-1.0, 1.0}
    assert 96 < int((s < 0).sum()) < 160  # not a degenerate diagonal


def test_rotation_rejects_non_power_of_two():
    with pytest.raises(ValueError):
        F.rotate(np.zeros((1, 48), np.float32))


@pytest.mark.parametrize("bits", [3, 5])
def test_codebooks_are_lloyd_max_fixed_points(bits):
    derived = F.lloyd_max_gaussian(1 << bits, iterations=20000)
    np.testing.assert_allclose(F.CODEBOOKS[bits], derived, rtol=0, atol=2e-6)
    # one Lloyd step from the table moves nothing (centroid condition)
    np.testing.assert_allclose(F.lloyd_step(F.CODEBOOKS[bits]), F.CODEBOOKS[bits], rtol=0, atol=2e-6)
    # and the start point is not already the answer (the test could fail)
    assert np.abs(F.lloyd_step(np.linspace(-2, 2, 1 << bits)) - np.linspace(-2, 2, 1 << bits)).max() > 1e-3


@pytest.mark.parametrize("bits,mse_known", [(3, 0.03454), (5, 0.0025)])
def test_codebook_mse_beats_perturbed_and_uniform(bits, mse_known):
    rng = np.random.default_rng(bits)
    z = rng.standard_normal(400_000).astype(np.float32)

    def mse(cb):
        edges = (cb[1:] + cb[:-1]) / 2
        return float(np.mean((cb[np.searchsorted(edges, z)] - z) ** 2))

    cb = F.CODEBOOKS[bits]
    m = mse(cb)
    assert abs(m - mse_known) < 0.03 * mse_known  # Max (1960): 0.03454 at 8 levels, 0.0025 at 32
    for scale in (0.95, 1.05):
        assert mse(cb * scale) > m
    lim = float(np.abs(cb).max())
    assert mse(np.linspace(-lim, lim, 1 << bits).astype(np.float32)) > m


@pytest.mark.parametrize("bits", [3, 5])
def test_pack_unpack_and_plane_layout(bits):
    rng = np.random.default_rng(bits)
    d = 64
    codes = rng.integers(0, 1 << bits, (3, 2, d)).astype(np.uint8)
    packed = F.pack_codes(codes, bits)
    assert packed.shape == (3, 2, d * bits // 8)
    np.testing.assert_array_equal(F.unpack_codes(packed, bits, d), codes)
    lo_w = 2 if bits == 3 else 4
    per = 8 // lo_w
    c = codes[1, 1]
    p = packed[1, 1]
    for i in range(d):  # the layout the module docstring promises a kernel
        lo = (p[i // per] >> (lo_w * (i % per))) & ((1 << lo_w) - 1)
        hi = (p[d * lo_w // 8 + i // 8] >> (i % 8)) & 1
        assert lo | (hi << lo_w) == c[i]


@pytest.mark.parametrize("bits,bound", [(3, 0.045), (5, 0.0035)])
def test_lloyd_max_round_trip_error(bits, bound):
    rng = np.random.default_rng(10 + bits)
    d = 256
    # K-like rows with a few outlier channels: the rotation spreads them
    x = rng.standard_normal((400, 4, d)).astype(np.float32)
    x[..., :4] *= 12
    packed, s = F.lm_quantize(x, bits)
    y = F.lm_dequantize(packed, s, bits, d)
    rel = np.sum((y - x) ** 2, -1) / np.sum(x ** 2, -1)
    assert rel.mean() < bound
    # the corrected norm keeps |x| up to fp16 rounding
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=2e-3)


def test_lloyd_max_zero_vector_and_determinism():
    x = np.zeros((2, 1, 64), np.float32)
    packed, s = F.lm_quantize(x, 3)
    assert not np.any(F.lm_dequantize(packed, s, 3, 64))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 2, 64)).astype(np.float32)
    a, b = F.lm_quantize(x, 5), F.lm_quantize(x.copy(), 5)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_more_bits_less_error_and_rotation_helps_outliers():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((200, 64)).astype(np.float32)
    x[:, 3] *= 20  # one outlier channel, as attention K often has
    err = {b: float(np.mean((F.lm_dequantize(*F.lm_quantize(x, b), b, 64) - x) ** 2)) for b in (3, 5)}
    assert err[5] < err[3] / 4
    # without the rotation the same codebook on the normalized coordinates does far worse
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    z = x / n * 8.0
    cb = F.CODEBOOKS[3]
    zq = cb[np.searchsorted(F.codebook_edges(3), z)]
    plain = float(np.mean((zq / 8.0 * n - x) ** 2))
    assert plain > 2 * err[3]


@pytest.mark.parametrize("name", F.FORMATS)
def test_format_payload_round_trip(name):
    fmt = F.get_format(name)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 2, 64)).astype(np.float32) * 3
    for which in ("k", "v"):
        payload = fmt.quantize(x, which)
        nbytes = sum(a.nbytes for a in payload.values()) // (6 * 2)
        kb, vb = fmt.row_bytes(64)
        assert nbytes == (kb if which == "k" else vb)
        y = fmt.dequantize(payload, which, 64)
        assert y.dtype == np.float32 and y.shape == x.shape
        rel = float(np.sum((y - x) ** 2) / np.sum(x ** 2))
        assert rel < {"bf16": 1e-5, "fp8": 2e-3, "k5v3": 5e-3 if which == "k" else 0.05, "k3v3": 0.05}[name]


def test_bytes_per_token_on_27b_shapes():
    b = {n: F.bytes_per_token(n, F.Q27B_KV_LAYERS, F.Q27B_KV_HEADS, F.Q27B_HEAD_DIM) for n in F.FORMATS}
    assert b["bf16"] == 17 * 4 * 2 * 512 == 69632
    assert b["fp8"] == 17 * 4 * 2 * 257
    assert b["k5v3"] == 17 * 4 * (162 + 98)
    assert b["k3v3"] == 17 * 4 * 2 * 98 == 13328
    assert b["k3v3"] <= 14500  # the bar: <= 14.5 KB per token
    assert b["bf16"] > b["fp8"] > b["k5v3"] > b["k3v3"]


def test_unknown_format_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown KV format"):
        F.get_format("int4")
