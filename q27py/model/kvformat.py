"""KV cache formats in numpy: the specification the CUDA store/attention kernels follow.

Every format maps one attention row (one position's K or V, [..., n_kv_heads, head_dim] fp32)
to a byte payload on store and back to fp32 on read. Dequantization is a pure function of the
stored bytes, so a cache may keep the dequantized rows beside the payload (the reference does);
what attention reads is exactly what a kernel that dequantizes in its inner loop reads.

Formats (per kv head and position; d = head_dim, a power of two for the rotated formats):

- ``bf16``: round-to-nearest-even bf16, 2 bytes per element.
- ``fp8``: e4m3 (OCP FP8: 1 sign, 4 exponent bits, bias 7, 3 mantissa bits, max 448, no
  infinities, S.1111.111 = NaN) with one power-of-two scale per (position, kv head), stored as
  an int8 exponent e. The scale is per row and per head rather than one static per-head scale
  because a row scale needs no calibration and can never saturate (the row's absolute max maps
  into [128, 256)), and because a power of two makes x * 2^-e and code * 2^e exact: the e4m3
  rounding is then the only error, the same relative error as an unscaled e4m3 of the same
  value, and a kernel folds 2^e into the attention score (K) or the softmax weight (V).
  Cost: 1 byte per head row (0.4 % at d = 256). Rounding: nearest, ties to even, saturating
  to +-448 (what the sm_89+ cvt.rn.satfinite.e4m3x2.f32 does).
- ``k5v3`` / ``k3v3`` (rotated Lloyd-Max, after TurboQuant): per head vector x, the norm
  n = |x|, u = H D x / (n sqrt d) with D a fixed pseudo-random sign diagonal and H the d x d
  Walsh-Hadamard matrix (so u is a unit vector whose coordinates are close to N(0, 1/d)), each
  coordinate sqrt(d) u_i coded as the nearest centroid of the b-bit Lloyd-Max quantizer of
  N(0, 1) (c the vector of centroids), and a corrected fp16 norm s = n sqrt(d) / |c| so the
  dequantized row x' = (s / sqrt(d)) R^T c, R^T c = D H c / sqrt(d), has the original norm.
  Because R is orthonormal a kernel may equally score R q against c and inverse-rotate the
  attention output once. K gets 5 (k5v3) or 3 (k3v3) bits, V 3 bits, both rotated (the rotation
  makes the error independent of the channel statistics; measured gain on the tiny models' V
  rows is small, 2 %: docs/KV.md).
  Bits are stored in planes so a thread reads whole bytes: 3-bit = a 2-bit plane (4 codes per
  byte, code i at bits 2*(i%4) of byte i//4) then a 1-bit plane (code i's bit 2 at bit i%8 of
  byte d/4 + i//8); 5-bit = a 4-bit plane (2 per byte) then a 1-bit plane.

Bytes per token for a model: see `bytes_per_token`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

FORMATS = ("bf16", "fp8", "k5v3", "k3v3")

# ---------------------------------------------------------------------------- bf16


def bf16_round(x: np.ndarray) -> np.ndarray:
    """fp32 -> nearest bf16 (ties to even), as fp32 (NaN stays NaN)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    out = (r & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, out)


# ---------------------------------------------------------------------------- fp8 e4m3

E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    """The value of every e4m3 code 0..255 (NaN for 0x7F / 0xFF)."""
    vals = np.empty(256, dtype=np.float32)
    for c in range(256):
        s, e, m = c >> 7, (c >> 3) & 0xF, c & 7
        if e == 0xF and m == 7:
            v = float("nan")
        elif e == 0:
            v = m / 8.0 * 2.0 ** -6
        else:
            v = (1.0 + m / 8.0) * 2.0 ** (e - 7)
        vals[c] = -v if s else v
    return vals


E4M3_VALUES = _e4m3_table()
_E4M3_POS = E4M3_VALUES[:0x7F].astype(np.float64)  # codes 0..126, ascending non-negative values


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """fp32 -> e4m3 codes (uint8): round to nearest, ties to even, saturate to +-448, NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x.astype(np.float64))
    # quantization step of |x|'s binade; every binade below 2^-6 is the subnormal step 2^-9
    _, ex = np.frexp(np.where(a > 0, a, 1.0))  # a = m 2^ex, m in [0.5, 1)
    step = np.exp2(np.maximum(ex - 1, -6) - 3)
    q = np.minimum(np.round(a / step) * step, E4M3_MAX)  # np.round: ties to even; exact in float64
    q = np.where(np.isnan(a), 0.0, q)
    code = np.searchsorted(_E4M3_POS, q).astype(np.uint8)  # q is exactly representable: exact hit
    code = code | np.where(np.signbit(x), np.uint8(0x80), np.uint8(0))
    code = np.where(np.isnan(x), np.uint8(0x7F), code)
    return code.astype(np.uint8)


def e4m3_decode(code: np.ndarray) -> np.ndarray:
    return E4M3_VALUES[np.asarray(code, dtype=np.uint8)]


FP8_EXP_MIN, FP8_EXP_MAX = -120, 120


def fp8_row_exponent(x: np.ndarray) -> np.ndarray:
    """The int8 scale exponent of each head row x [..., d]: amax * 2^-e lands in [128, 256)."""
    amax = np.max(np.abs(np.asarray(x, dtype=np.float32)), axis=-1)
    _, ex = np.frexp(np.where(amax > 0, amax, 1.0).astype(np.float64))  # amax = m 2^ex
    e = np.where(amax > 0, ex - 8, 0)
    e = np.where(np.isfinite(amax), e, 0)
    return np.clip(e, FP8_EXP_MIN, FP8_EXP_MAX).astype(np.int8)


def fp8_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., d] fp32 -> (codes uint8 [..., d], exponents int8 [...])."""
    x = np.asarray(x, dtype=np.float32)
    e = fp8_row_exponent(x)
    scaled = x * np.exp2(-e.astype(np.float32))[..., None]  # a power of two: exact in fp32
    return e4m3_encode(scaled), e


def fp8_dequantize(codes: np.ndarray, exps: np.ndarray) -> np.ndarray:
    return e4m3_decode(codes) * np.exp2(np.asarray(exps, dtype=np.float32))[..., None]


# ---------------------------------------------------------------------------- rotation


def _fmix32(h: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finalizer (a bijective mix): the sign diagonal's source of bits."""
    h = h.astype(np.uint64) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def rotation_signs(d: int) -> np.ndarray:
    """D's diagonal: sign i = -1 when bit 0 of fmix32(i + 0x9E3779B9) is set (CUDA computes the same)."""
    bits = _fmix32(np.arange(d, dtype=np.uint64) + 0x9E3779B9) & 1
    return np.where(bits == 1, -1.0, 1.0).astype(np.float32)


def _check_pow2(d: int) -> None:
    if d < 2 or d & (d - 1):
        raise ValueError(f"rotated KV formats need a power-of-two head_dim, not {d}")


def fwht(x: np.ndarray) -> np.ndarray:
    """Unnormalized Walsh-Hadamard transform over the last axis (butterfly order, fp32)."""
    x = np.array(x, dtype=np.float32, copy=True)
    d = x.shape[-1]
    _check_pow2(d)
    h = 1
    while h < d:
        y = x.reshape(x.shape[:-1] + (d // (2 * h), 2, h))
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :] = a + b
        y[..., 1, :] = a - b
        x = y.reshape(x.shape)
        h *= 2
    return x


def rotate(x: np.ndarray) -> np.ndarray:
    """R x = H D x / sqrt(d): orthonormal."""
    d = x.shape[-1]
    return fwht(np.asarray(x, np.float32) * rotation_signs(d)) * np.float32(1.0 / math.sqrt(d))


def unrotate(y: np.ndarray) -> np.ndarray:
    """R^T y = D H y / sqrt(d)."""
    d = y.shape[-1]
    return fwht(y) * np.float32(1.0 / math.sqrt(d)) * rotation_signs(d)


# ---------------------------------------------------------------------------- Lloyd-Max codebooks


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _Phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def lloyd_step(c: np.ndarray) -> np.ndarray:
    """One Lloyd iteration for N(0, 1): cells split at midpoints, each centroid -> its cell's mean,
    (phi(a) - phi(b)) / (Phi(b) - Phi(a)). A Lloyd-Max quantizer is a fixed point."""
    c = np.asarray(c, dtype=np.float64)
    edges = np.concatenate([[-np.inf], (c[1:] + c[:-1]) / 2, [np.inf]])
    new = np.empty_like(c)
    for i in range(c.size):
        a, b = edges[i], edges[i + 1]
        pa = 0.0 if np.isinf(a) else _phi(a)
        pb = 0.0 if np.isinf(b) else _phi(b)
        mass = (_Phi(b) if np.isfinite(b) else 1.0) - (_Phi(a) if np.isfinite(a) else 0.0)
        new[i] = (pa - pb) / mass
    return new


def lloyd_max_gaussian(levels: int, iterations: int = 2000) -> np.ndarray:
    """The Lloyd-Max (minimum-MSE) quantizer of N(0, 1) with `levels` centroids, by Lloyd iteration
    from the uniform quantiles (float64; deterministic)."""
    c = np.array([_inv_Phi((i + 0.5) / levels) for i in range(levels)])
    for _ in range(iterations):
        new = lloyd_step(c)
        if np.max(np.abs(new - c)) < 1e-13:
            return new
        c = new
    return c


def _inv_Phi(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if _Phi(mid) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# Positive centroids of the N(0, 1) Lloyd-Max quantizers (the negative half mirrors them): the
# constant tables a kernel carries. tests/model/test_kvformat.py re-derives them by Lloyd
# iteration (lloyd_max_gaussian) and checks they are its fixed point.
_HALF = {
    3: (0.245094179, 0.756005281, 1.343909279, 2.151945705),
    5: (0.065889660, 0.198051830, 0.331378306, 0.466699523, 0.604933624, 0.747135704, 0.894565117,
        1.048783320, 1.211804381, 1.386340340, 1.576228079, 1.787233218, 2.028728399, 2.317739404,
        2.691119577, 3.260732493),
}
CODEBOOKS = {bits: np.array([-v for v in reversed(h)] + list(h), dtype=np.float32) for bits, h in _HALF.items()}


def codebook_edges(bits: int) -> np.ndarray:
    c = CODEBOOKS[bits].astype(np.float32)
    return ((c[1:] + c[:-1]) * np.float32(0.5)).astype(np.float32)


# ---------------------------------------------------------------------------- bit planes


def _planes(bits: int) -> tuple[int, int]:
    """(low-plane width, high-plane width) of a code."""
    return {3: (2, 1), 5: (4, 1)}[bits]


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """codes [..., d] (values < 2^bits) -> bytes [..., d*bits/8] in the plane layout (module docstring)."""
    lo_w, hi_w = _planes(bits)
    codes = np.asarray(codes, dtype=np.uint8)
    out = []
    for shift, width in ((0, lo_w), (lo_w, hi_w)):
        field = (codes >> shift) & ((1 << width) - 1)
        b = ((field[..., None] >> np.arange(width, dtype=np.uint8)) & 1).astype(np.uint8)
        out.append(np.packbits(b.reshape(codes.shape[:-1] + (-1,)), axis=-1, bitorder="little"))
    return np.concatenate(out, axis=-1)


def unpack_codes(packed: np.ndarray, bits: int, d: int) -> np.ndarray:
    lo_w, hi_w = _planes(bits)
    packed = np.asarray(packed, dtype=np.uint8)
    n_lo = d * lo_w // 8
    codes = np.zeros(packed.shape[:-1] + (d,), dtype=np.uint8)
    for shift, width, plane in ((0, lo_w, packed[..., :n_lo]), (lo_w, hi_w, packed[..., n_lo:])):
        b = np.unpackbits(plane, axis=-1, bitorder="little").reshape(packed.shape[:-1] + (d, width))
        codes |= (np.sum(b.astype(np.uint8) << np.arange(width, dtype=np.uint8), axis=-1).astype(np.uint8) << shift)
    return codes


# ---------------------------------------------------------------------------- rotated Lloyd-Max

FP16_MAX = 65504.0


def lm_quantize(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """x [..., d] fp32 -> (packed codes uint8 [..., d*bits/8], corrected norm fp16 [...])."""
    x = np.asarray(x, dtype=np.float32)
    d = x.shape[-1]
    _check_pow2(d)
    n = np.sqrt(np.sum(x.astype(np.float32) ** 2, axis=-1, dtype=np.float32))
    safe = np.where(n > 0, n, np.float32(1.0)).astype(np.float32)
    z = rotate(x) * (np.float32(math.sqrt(d)) / safe)[..., None]  # ~ N(0, 1) per coordinate
    codes = np.searchsorted(codebook_edges(bits), z, side="left").astype(np.uint8)
    c = CODEBOOKS[bits][codes]
    cn = np.sqrt(np.sum(c * c, axis=-1, dtype=np.float32)).astype(np.float32)
    # dequant = s * unrotate(c) / sqrt(d); |unrotate(c)| = |c|, so s = n sqrt(d) / |c| restores |x|
    s = np.where(n > 0, n * np.float32(math.sqrt(d)) / cn, np.float32(0.0))
    s16 = np.minimum(s, np.float32(FP16_MAX)).astype(np.float16)
    return pack_codes(codes, bits), s16


def lm_dequantize(packed: np.ndarray, norms: np.ndarray, bits: int, d: int) -> np.ndarray:
    c = CODEBOOKS[bits][unpack_codes(packed, bits, d)]
    return unrotate(c) * (np.asarray(norms, dtype=np.float32) * np.float32(1.0 / math.sqrt(d)))[..., None]


# ---------------------------------------------------------------------------- formats


@dataclass(frozen=True)
class KVFormat:
    """One format's K and V codecs; bits None = not a rotated Lloyd-Max codec."""

    name: str
    k_bits: int | None = None
    v_bits: int | None = None

    def row_bytes(self, head_dim: int) -> tuple[int, int]:
        """Bytes of one (position, kv head) row of K and of V."""
        if self.name == "bf16":
            return 2 * head_dim, 2 * head_dim
        if self.name == "fp8":
            return head_dim + 1, head_dim + 1
        return head_dim * self.k_bits // 8 + 2, head_dim * self.v_bits // 8 + 2

    def quantize(self, x: np.ndarray, which: str) -> dict[str, np.ndarray]:
        """Rows [..., d] -> payload arrays (what a cache stores)."""
        if self.name == "bf16":
            return {"bf16": (bf16_round(x).view(np.uint32) >> 16).astype(np.uint16)}
        if self.name == "fp8":
            codes, exps = fp8_quantize(x)
            return {"codes": codes, "exp": exps}
        bits = self.k_bits if which == "k" else self.v_bits
        packed, norms = lm_quantize(x, bits)
        return {"codes": packed, "norm": norms}

    def dequantize(self, payload: dict[str, np.ndarray], which: str, d: int) -> np.ndarray:
        if self.name == "bf16":
            return (payload["bf16"].astype(np.uint32) << 16).view(np.float32)
        if self.name == "fp8":
            return fp8_dequantize(payload["codes"], payload["exp"])
        bits = self.k_bits if which == "k" else self.v_bits
        return lm_dequantize(payload["codes"], payload["norm"], bits, d)

    def roundtrip(self, x: np.ndarray, which: str) -> np.ndarray:
        return self.dequantize(self.quantize(x, which), which, x.shape[-1])


KV_FORMATS = {
    "bf16": KVFormat("bf16"),
    "fp8": KVFormat("fp8"),
    "k5v3": KVFormat("k5v3", 5, 3),
    "k3v3": KVFormat("k3v3", 3, 3),
}


def get_format(name: str) -> KVFormat:
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV format {name!r} (one of {', '.join(FORMATS)})") from None


def bytes_per_token(fmt: str, n_kv_layers: int, n_kv_heads: int, head_dim: int) -> int:
    """Cache bytes one position costs over all attention layers (the MTP layer counted in n_kv_layers)."""
    kb, vb = get_format(fmt).row_bytes(head_dim)
    return n_kv_layers * n_kv_heads * (kb + vb)


def model_bytes_per_token(fmt: str, cfg, with_mtp: bool = True) -> int:
    """bytes_per_token for a ModelConfig: its full-attention layers plus the MTP layer."""
    layers = len(cfg.full_layers) + (1 if with_mtp else 0)
    return bytes_per_token(fmt, layers, cfg.num_key_value_heads, cfg.head_dim)


# The 27B's attention shapes (16 full-attention layers + the MTP layer, 4 kv heads x 256).
Q27B_KV_LAYERS, Q27B_KV_HEADS, Q27B_HEAD_DIM = 17, 4, 256
