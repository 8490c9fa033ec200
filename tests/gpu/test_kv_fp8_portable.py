"""The portable (pre-sm_89) e4m3 conversions of cuda/common.cuh, emulated bit for bit in numpy on
the CPU and checked against the specification (kvformat.e4m3_encode / e4m3_decode). The device
itself runs tests/gpu/test_kv_fp8.py; this keeps the bit tricks honest where no GPU is present."""

from __future__ import annotations

import numpy as np

from q27py.gpu.runtime import source_text
from q27py.model import kvformat as F


def portable_encode(x: np.ndarray) -> np.ndarray:
    """float_to_e4m3's #else branch, line by line."""
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32)
    s = ((u >> 24) & 0x80).astype(np.uint32)
    a = np.abs(x)
    b = a.view(np.uint32).astype(np.uint64)
    b = b + 0x7FFFF + ((b >> 20) & 1)
    e = (b >> 23).astype(np.int64) - 127 + 7
    code = np.minimum((e << 3) | ((b >> 20) & 7).astype(np.int64), 0x7E)
    sub = np.rint(np.where(a < 1, a, np.float32(0.0)) * np.float32(512.0)).astype(np.int64)  # __float2int_rn: ties to even
    out = np.where(a < np.float32(0.015625), sub, code)
    out = np.where(a >= np.float32(464.0), 0x7E, out)
    out = np.where(np.isnan(a), 0x7F, out)
    return (out.astype(np.uint32) | s).astype(np.uint8)


def portable_decode_div256(c: np.ndarray) -> np.ndarray:
    """e4m3_to_float_div256: the code's bits placed into an fp16."""
    c = np.asarray(c, np.uint16)
    return (((c & 0x80) << 8) | ((c & 0x7F) << 7)).astype(np.uint16).view(np.float16).astype(np.float32)


def test_source_has_the_emulated_branch():
    src = source_text("rope")
    for line in ("b += 0x7ffffu + ((b >> 20) & 1u);", "if (a >= 464.f)", "__float2int_rn(a * 512.f)",
                 "cvt.rn.satfinite.e4m3x2.f32", "__CUDA_ARCH__ >= 890"):
        assert line in src


def test_portable_encode_matches_spec():
    rng = np.random.default_rng(0)
    vals = F.E4M3_VALUES[:127].astype(np.float64)
    mids = (vals[1:] + vals[:-1]) / 2
    x = np.concatenate([vals, -vals, mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9),
                        rng.standard_normal(200000) * np.exp2(rng.integers(-16, 10, 200000)),
                        [448, 449, 463.9, 464, 465, 1e30, -1e30, np.inf, -np.inf, 2.0 ** -10, 1e-45]]).astype(np.float32)
    np.testing.assert_array_equal(portable_encode(x), F.e4m3_encode(x))
    nan = portable_encode(np.float32([np.nan]))
    assert nan[0] & 0x7F == 0x7F


def test_portable_decode_is_exact():
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], np.uint8)
    np.testing.assert_array_equal(portable_decode_div256(codes) * 256, F.E4M3_VALUES[codes])
