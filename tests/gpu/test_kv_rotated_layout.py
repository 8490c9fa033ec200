"""CPU emulation of the rotated-KV index math in cuda/common.cuh (no GPU needed): the code unpacking
the decode and prefill kernels use (lm_code, lm_codes8's one-word + one-byte reads) and the plane
packing of lm_quantize_block, against kvformat's pack_codes / unpack_codes -- so a layout slip
surfaces here rather than as a tolerance failure on the device."""

from __future__ import annotations

import numpy as np
import pytest

from q27py.model import kvformat as F

DIMS = (32, 64, 128, 256)


def lo_bits(bits: int) -> int:
    return 2 if bits == 3 else 4


def lm_code(row: np.ndarray, i: int, d: int, bits: int) -> int:
    """common.cuh lm_code, line for line."""
    lw = lo_bits(bits)
    per = 8 // lw
    lo = (int(row[i // per]) >> (lw * (i % per))) & ((1 << lw) - 1)
    hi = (int(row[d * lw // 8 + i // 8]) >> (i % 8)) & 1
    return lo | (hi << lw)


def lm_codes8(row: np.ndarray, i0: int, d: int, bits: int) -> list[int]:
    """common.cuh lm_codes8: a little-endian u16 (3-bit) / u32 (5-bit) word of the low plane at
    byte i0 / 4 or i0 / 2, and one high-plane byte."""
    assert i0 % 8 == 0
    hb = int(row[d * lo_bits(bits) // 8 + i0 // 8])
    if bits == 3:
        off = i0 // 4
        assert off % 2 == 0  # the u16 load is aligned within the row
        w = int(row[off:off + 2].view("<u2")[0])
        return [((w >> (2 * k)) & 3) | (((hb >> k) & 1) << 2) for k in range(8)]
    off = i0 // 2
    assert off % 4 == 0  # the u32 load is aligned within the row
    w = int(row[off:off + 4].view("<u4")[0])
    return [((w >> (4 * k)) & 15) | (((hb >> k) & 1) << 4) for k in range(8)]


def pack_like_kernel(codes: np.ndarray, d: int, bits: int) -> np.ndarray:
    """lm_quantize_block's packing loops: thread i writes low-plane byte i (i < d / per) and
    high-plane byte i (i < d / 8)."""
    lw = lo_bits(bits)
    per = 8 // lw
    row = np.zeros(d * bits // 8, np.uint8)
    for i in range(d):
        if i < d // per:
            b = 0
            for k in range(per):
                b |= (int(codes[i * per + k]) & ((1 << lw) - 1)) << (lw * k)
            row[i] = b
        if i < d // 8:
            b = 0
            for k in range(8):
                b |= ((int(codes[i * 8 + k]) >> lw) & 1) << k
            row[d * lw // 8 + i] = b
    return row


@pytest.mark.parametrize("bits", [3, 5])
@pytest.mark.parametrize("d", DIMS)
def test_kernel_unpacking_matches_spec(d, bits):
    rng = np.random.default_rng(d * bits)
    codes = rng.integers(0, 1 << bits, (6, d)).astype(np.uint8)
    packed = F.pack_codes(codes, bits)
    assert packed.shape[-1] == d * bits // 8 and (d * bits // 8) % 4 == 0  # rows keep 4-byte alignment
    for r in range(codes.shape[0]):
        row = packed[r]
        assert [lm_code(row, i, d, bits) for i in range(d)] == codes[r].tolist()
        got = sum((lm_codes8(row, i0, d, bits) for i0 in range(0, d, 8)), [])
        assert got == codes[r].tolist()
    np.testing.assert_array_equal(F.unpack_codes(packed, bits, d), codes)


@pytest.mark.parametrize("bits", [3, 5])
@pytest.mark.parametrize("d", DIMS)
def test_kernel_packing_matches_spec(d, bits):
    rng = np.random.default_rng(100 + d * bits)
    codes = rng.integers(0, 1 << bits, (4, d)).astype(np.uint8)
    want = F.pack_codes(codes, bits)
    for r in range(codes.shape[0]):
        np.testing.assert_array_equal(pack_like_kernel(codes[r], d, bits), want[r])


@pytest.mark.parametrize("fmt", ["k5v3", "k3v3"])
def test_cache_row_strides_keep_word_loads_aligned(fmt):
    """Cache rows [layer][kv head][position][hd * bits / 8]: every row start (any layer, head,
    position) is a multiple of 4 bytes, so lm_codes8's u16 / u32 loads are aligned anywhere."""
    f = F.get_format(fmt)
    for d in DIMS:
        for bits in (f.k_bits, f.v_bits):
            stride = d * bits // 8
            assert stride % 4 == 0
    assert F.get_format(fmt).row_bytes(256) == (256 * f.k_bits // 8 + 2, 256 * f.v_bits // 8 + 2)


def test_dequantized_rotated_value_is_what_the_kernels_compute():
    """The kernels score in the rotated basis: q . x' = (R q) . c * s / sqrt(d), and the output
    sum p x'_v = R^T (sum p c_v s_v / sqrt(d)) -- the identities attention_rotated and the rotated
    prefill tiles rely on (R orthonormal), checked on the spec's own dequantization."""
    rng = np.random.default_rng(7)
    d = 64
    x = rng.standard_normal((5, d)).astype(np.float32)
    q = rng.standard_normal(d).astype(np.float32)
    for bits in (3, 5):
        packed, norms = F.lm_quantize(x, bits)
        xd = F.lm_dequantize(packed, norms, bits, d)
        c = F.CODEBOOKS[bits][F.unpack_codes(packed, bits, d)]
        sc = norms.astype(np.float32) / np.float32(np.sqrt(d))
        np.testing.assert_allclose(xd @ q, (c @ F.rotate(q)) * sc, rtol=1e-4, atol=1e-4)
        p = rng.random(5).astype(np.float32)
        np.testing.assert_allclose(p @ xd, F.unrotate((p * sc) @ c), rtol=1e-4, atol=1e-4)
