"""Packed weight layouts for the GEMV/GEMM kernels (cuda/gemv.cu), in numpy.

This module is the specification of the bytes (docs/FORMAT.md "packed matrices"): the
CUDA packer (cuda/quant.cu) must produce the same bytes, the repack tool writes them to
disk with it, and the tests use it as the oracle. No cupy here.

A matrix W [N, K] (rows = outputs, K = reduction axis) is cut into row tiles of 16 rows
and chunks of 64 k. Each (tile, chunk) block holds one warp's mma.m16n8k16 A fragments
for four k16 steps, so a thread's 16-byte load is exactly its fragment:

    lane l: g = l // 4, t = l % 4; for step s the thread holds
      a0 = (row g,   k, k+1)   a1 = (row g+8, k, k+1)
      a2 = (row g, k+8, k+9)   a3 = (row g+8, k+8, k+9)      with k = 16 s + 2 t

- bf16: 2048 bytes per block; uint4 at s*512 + l*16 holds (a0, a1, a2, a3), low half =
  lower k.
- q8:   1024 bytes; uint4 at j*512 + l*16 holds steps 2j, 2j+1, two words each:
  word A = bytes [(g,k), (g+8,k), (g,k+1), (g+8,k+1)], word B = the same at k+8. Bytes
  are code + 128 (codes in [-127, 127]).
- q4:   512 bytes; uint4 at l*16, word s is step s; nibble slot q (bits 4q..4q+3) holds
  pair p = q % 4, element e = q // 4: row g + 8 (p % 2), k + 8 (p // 2) + e. Nibbles are
  code + 8 (codes in [-7, 7]).

Scales (q8, q4): fp16 per (row, group of `group` k), stored per (tile, group) as 8 pairs
(row g, row g+8) -> uint32 [tiles, groups, 8]. Rows are padded to a multiple of 64 (whole
row groups of 4 tiles); rows past N and k past K are zero codes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

FMT_BF16, FMT_Q8, FMT_Q4 = 0, 1, 2
FMT_NAMES = {"bf16": FMT_BF16, "q8": FMT_Q8, "q4": FMT_Q4}
CHUNK_BYTES = {FMT_BF16: 2048, FMT_Q8: 1024, FMT_Q4: 512}
QMAX = {FMT_Q8: 127, FMT_Q4: 7}
DEFAULT_GROUP = {FMT_BF16: 64, FMT_Q8: 128, FMT_Q4: 64}
TILE_ROWS, CHUNK_K = 16, 64


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


@dataclass(frozen=True)
class MatrixShape:
    """Geometry of one packed matrix; everything the kernels need besides the pointers. The derived sizes are
    cached on first use (the eager prefill asks for them thousands of times a forward: tools/prefill_host_profile.py);
    the fields are frozen, so a cached value never goes stale."""

    rows: int
    cols: int  # K before padding
    fmt: int
    group: int  # k per scale (multiple of 64); ignored for bf16

    @cached_property
    def kpad(self) -> int:
        return round_up(self.cols, CHUNK_K)

    @cached_property
    def kchunks(self) -> int:
        return self.kpad // CHUNK_K

    @cached_property
    def row_tiles(self) -> int:
        # padded to whole row groups of 4 tiles (64 rows): the GEMV walks a group's tiles at a fixed stride
        return round_up(self.rows, 4 * TILE_ROWS) // TILE_ROWS

    @cached_property
    def groups(self) -> int:
        return -(-self.kpad // self.group)

    @cached_property
    def group_chunks(self) -> int:
        return self.group // CHUNK_K

    @cached_property
    def code_bytes(self) -> int:
        return self.row_tiles * self.kchunks * CHUNK_BYTES[self.fmt]

    @cached_property
    def scale_bytes(self) -> int:
        return 0 if self.fmt == FMT_BF16 else self.row_tiles * self.groups * 8 * 4


def matrix_shape(rows: int, cols: int, fmt: int, group: int | None = None) -> MatrixShape:
    group = DEFAULT_GROUP[fmt] if group is None else group
    if group % CHUNK_K:
        raise ValueError(f"group {group} must be a multiple of {CHUNK_K}")
    return MatrixShape(rows, cols, fmt, group)


# ---------------------------------------------------------------- fragment index maps
def _fragment_maps():
    """(row, k) inside a 16x64 block for each element of the three layouts, in storage order."""
    lanes = np.arange(32)
    g, t = lanes // 4, lanes % 4
    # bf16: element index e = s*256 + l*8 + j (u16 units)
    s, l, j = np.meshgrid(np.arange(4), lanes, np.arange(8), indexing="ij")
    gg, tt = g[l], t[l]
    reg, half = j // 2, j % 2  # reg 0..3 = a0..a3
    bf_row = gg + 8 * (reg % 2)
    bf_k = 16 * s + 2 * tt + 8 * (reg // 2) + half
    # q8: byte index e = jj*512 + l*16 + sub*8 + word*4 + b
    jj, l, sub, word, b = np.meshgrid(np.arange(2), lanes, np.arange(2), np.arange(2), np.arange(4), indexing="ij")
    step = 2 * jj + sub
    q8_row = g[l] + 8 * (b % 2)
    q8_k = 16 * step + 2 * t[l] + 8 * word + b // 2
    # q4: nibble index v = l*32 + s*8 + q
    l, s, q = np.meshgrid(lanes, np.arange(4), np.arange(8), indexing="ij")
    p, e = q % 4, q // 4
    q4_row = g[l] + 8 * (p % 2)
    q4_k = 16 * s + 2 * t[l] + 8 * (p // 2) + e
    return {
        FMT_BF16: (bf_row.reshape(-1), bf_k.reshape(-1)),
        FMT_Q8: (q8_row.reshape(-1), q8_k.reshape(-1)),
        FMT_Q4: (q4_row.reshape(-1), q4_k.reshape(-1)),
    }


FRAGMENT_MAPS = _fragment_maps()


def _blocks(values: np.ndarray, shape: MatrixShape) -> np.ndarray:
    """[N, K] -> zero-padded [tiles, chunks, 16, 64]."""
    padded = np.zeros((shape.row_tiles * TILE_ROWS, shape.kpad), dtype=values.dtype)
    padded[: values.shape[0], : values.shape[1]] = values
    return padded.reshape(shape.row_tiles, TILE_ROWS, shape.kchunks, CHUNK_K).transpose(0, 2, 1, 3)


# ---------------------------------------------------------------- quantization
def quantize(w: np.ndarray, fmt: int, group: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric groupwise quantization of fp32 w [N, K] -> (codes int8 [N, K], scales fp16 [N, groups]).

    scale = fp16(absmax / qmax); code = clip(rint(w / scale), -qmax, qmax) with the
    division in fp32 by the fp16-rounded scale (what the CUDA packer does, bit for bit).
    """
    shape = matrix_shape(w.shape[0], w.shape[1], fmt, group)
    qmax = np.float32(QMAX[fmt])
    w = np.ascontiguousarray(w, dtype=np.float32)
    padded = np.zeros((w.shape[0], shape.groups * shape.group), dtype=np.float32)
    padded[:, : w.shape[1]] = w
    grouped = padded.reshape(w.shape[0], shape.groups, shape.group)
    absmax = np.abs(grouped).max(axis=2)
    scales = np.minimum(absmax / qmax, np.float32(65504.0)).astype(np.float16)
    s32 = scales.astype(np.float32)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(s32 > 0, np.rint(grouped / np.where(s32 > 0, s32, 1)), 0)
    codes = np.clip(codes, -qmax, qmax).astype(np.int8).reshape(w.shape[0], -1)[:, : w.shape[1]]
    return codes, scales


def dequantize(codes: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """The exact float32 values the kernels multiply by (code * scale, per group)."""
    rep = np.repeat(scales.astype(np.float32), group, axis=1)[:, : codes.shape[1]]
    return codes.astype(np.float32) * rep


# ---------------------------------------------------------------- packing
def pack_codes(values: np.ndarray, shape: MatrixShape) -> np.ndarray:
    """values: bf16 bits (uint16) for bf16, int8 codes otherwise -> packed uint8 blob."""
    rows, ks = FRAGMENT_MAPS[shape.fmt]
    if shape.fmt == FMT_BF16:
        blocks = _blocks(np.ascontiguousarray(values, dtype=np.uint16), shape)
        return np.ascontiguousarray(blocks[:, :, rows, ks]).reshape(-1).view(np.uint8)
    if shape.fmt == FMT_Q8:
        biased = (values.astype(np.int16) + 128).astype(np.uint8)
        blocks = _pad_fill(values, shape, _blocks(biased, shape))
        return np.ascontiguousarray(blocks[:, :, rows, ks]).reshape(-1)
    nib = (values.astype(np.int16) + 8).astype(np.uint8)
    blocks = _pad_fill(values, shape, _blocks(nib, shape))
    v = blocks[:, :, rows, ks].reshape(shape.row_tiles, shape.kchunks, CHUNK_BYTES[FMT_Q4], 2)
    return (v[..., 0] | (v[..., 1] << 4)).astype(np.uint8).reshape(-1)


def _pad_fill(values: np.ndarray, shape: MatrixShape, blocks: np.ndarray) -> np.ndarray:
    """Padding positions must hold the zero code (128 for q8, 8 for q4), not a zero byte."""
    zero = 128 if shape.fmt == FMT_Q8 else 8
    mask = np.zeros((shape.row_tiles * TILE_ROWS, shape.kpad), dtype=bool)
    mask[: values.shape[0], : values.shape[1]] = True
    m = mask.reshape(shape.row_tiles, TILE_ROWS, shape.kchunks, CHUNK_K).transpose(0, 2, 1, 3)
    out = blocks.copy()
    out[~m] = zero
    return out


def pack_scales(scales: np.ndarray, shape: MatrixShape) -> np.ndarray:
    """fp16 [N, groups] -> uint32 [tiles, groups, 8] pairs (row g | row g+8 << 16)."""
    full = np.zeros((shape.row_tiles * TILE_ROWS, shape.groups), dtype=np.float16)
    full[: scales.shape[0]] = scales
    bits = full.view(np.uint16).astype(np.uint32).reshape(shape.row_tiles, TILE_ROWS, shape.groups)
    pairs = bits[:, :8, :] | (bits[:, 8:, :] << 16)  # [tiles, 8, groups]
    return np.ascontiguousarray(pairs.transpose(0, 2, 1)).reshape(-1)


def bf16_bits(w: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, round to nearest even (NaN kept NaN)."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass
class PackedMatrix:
    """Host-side packed matrix: codes blob, scales blob (empty for bf16), geometry."""

    shape: MatrixShape
    codes: np.ndarray  # uint8
    scales: np.ndarray  # uint32 (empty for bf16)

    def dequantized(self) -> np.ndarray:
        """The float32 matrix the kernels compute with (for tests)."""
        return unpack(self)


def pack_matrix(w: np.ndarray, fmt: int, group: int | None = None) -> PackedMatrix:
    """Quantize (q4/q8) or round (bf16) fp32 w [N, K] and pack it."""
    shape = matrix_shape(w.shape[0], w.shape[1], fmt, group)
    if fmt == FMT_BF16:
        return PackedMatrix(shape, pack_codes(bf16_bits(w), shape), np.zeros(0, np.uint32))
    codes, scales = quantize(w, fmt, shape.group)
    return PackedMatrix(shape, pack_codes(codes, shape), pack_scales(scales, shape))


def interleave_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Rows of [gate; up] ordered so each 16-row tile is 8 gate rows then the matching 8 up rows.

    The GEMV's SwiGLU epilogue then finds gate and up of one output in the same thread.
    """
    i = gate.shape[0]
    ip = round_up(i, 8)
    g = np.zeros((ip, gate.shape[1]), dtype=gate.dtype)
    u = np.zeros_like(g)
    g[:i], u[:i] = gate, up
    return np.stack([g.reshape(-1, 8, gate.shape[1]), u.reshape(-1, 8, gate.shape[1])], axis=1).reshape(2 * ip, -1)


# ---------------------------------------------------------------- emulation (tests)
def _bf16x2_floats(word: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo = bf16_to_f32((word & 0xFFFF).astype(np.uint16))
    hi = bf16_to_f32((word >> 16).astype(np.uint16))
    return lo, hi


def emulate_fragments(codes: np.ndarray, shape: MatrixShape, tile: int, chunk: int) -> np.ndarray:
    """Decode one 16x64 block the way the kernel does (bit tricks included) -> float32 [16, 64]."""
    cb = CHUNK_BYTES[shape.fmt]
    blk = codes[(tile * shape.kchunks + chunk) * cb : (tile * shape.kchunks + chunk + 1) * cb]
    words = blk.view(np.uint32)
    out = np.full((16, 64), np.nan, dtype=np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for s in range(4):
            k = 16 * s + 2 * t
            if shape.fmt == FMT_BF16:
                regs = words[(s * 512 + lane * 16) // 4 : (s * 512 + lane * 16) // 4 + 4]
                pairs = [_bf16x2_floats(r) for r in regs]
            elif shape.fmt == FMT_Q8:
                base = ((s // 2) * 512 + lane * 16) // 4 + 2 * (s % 2)
                wa, wb = int(words[base]), int(words[base + 1])
                pairs = [_q8_pair(wa), _q8_pair(wa >> 8), _q8_pair(wb), _q8_pair(wb >> 8)]
            else:
                q = int(words[lane * 4 + s])
                pairs = [_q4_pair(q), _q4_pair(q >> 4), _q4_pair(q >> 8), _q4_pair(q >> 12)]
            for reg, (lo, hi) in enumerate(pairs):
                r = g + 8 * (reg % 2)
                kk = k + 8 * (reg // 2)
                out[r, kk], out[r, kk + 1] = lo, hi
    return out


def _q4_pair(q: int):
    x = (q & 0x000F000F) | 0x43004300
    lo, hi = _bf16x2_floats(np.array([x], dtype=np.uint32))
    return float(lo[0]) - 136.0, float(hi[0]) - 136.0


def _q8_pair(v: int):
    x = (v & 0x007F007F) | 0x43004300
    c = (v & 0x00800080) ^ 0x43804380
    xl, xh = _bf16x2_floats(np.array([x], dtype=np.uint32))
    cl, ch = _bf16x2_floats(np.array([c], dtype=np.uint32))
    return float(xl[0] - cl[0]), float(xh[0] - ch[0])


def unpack(pm: PackedMatrix) -> np.ndarray:
    """Inverse of pack_matrix through the storage maps (fast, vectorized): float32 [N, K]."""
    shape = pm.shape
    rows, ks = FRAGMENT_MAPS[shape.fmt]
    nt, nc = shape.row_tiles, shape.kchunks
    full = np.zeros((nt, nc, 16, 64), dtype=np.float32)
    if shape.fmt == FMT_BF16:
        vals = bf16_to_f32(pm.codes.view(np.uint16).reshape(nt, nc, -1))
    elif shape.fmt == FMT_Q8:
        vals = pm.codes.reshape(nt, nc, -1).astype(np.float32) - 128.0
    else:
        b = pm.codes.reshape(nt, nc, -1)
        vals = np.stack([b & 15, b >> 4], axis=-1).reshape(nt, nc, -1).astype(np.float32) - 8.0
    full[:, :, rows, ks] = vals
    if shape.fmt != FMT_BF16:
        pairs = pm.scales.reshape(nt, shape.groups, 8)
        lo = (pairs & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32)
        hi = (pairs >> 16).astype(np.uint16).view(np.float16).astype(np.float32)
        sc = np.concatenate([lo, hi], axis=2)  # [tiles, groups, 16 rows]
        chunk_group = np.arange(nc) // shape.group_chunks
        full *= sc[:, chunk_group, :][:, :, :, None]
    return full.transpose(0, 2, 1, 3).reshape(nt * 16, nc * 64)[: shape.rows, : shape.cols]


# ---------------------------------------------------------------- a8 activations (cuda/gemv.cu quant_act8)
def act8_order() -> np.ndarray:
    """k (inside a 64-k chunk) stored at each byte of the chunk: byte t*16 + s*4 + j holds
    k = 16 s + 2 t + (0, 8, 1, 9)[j] -- the k slots thread (g, t) holds weights for in the q4 and q8
    layouts, so a thread's 16-byte load is its B fragments for both k32 steps of the chunk."""
    t, s, j = np.meshgrid(np.arange(4), np.arange(4), np.arange(4), indexing="ij")
    return (16 * s + 2 * t + np.array([0, 8, 1, 9])[j]).reshape(-1)


def quantize_act8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The a8 GEMV's activations: x [n, kpad] fp32 -> (codes int8 [n, kpad] in natural k order,
    scales fp32 [n, kpad / 64]), bit-exact with the kernel: scale = amax / 127 and
    code = rint(x * (127 / amax)) clipped to +-127, per (row, 64-k chunk); zero chunks scale 0."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, kpad = x.shape
    assert kpad % CHUNK_K == 0
    xc = x.reshape(n, kpad // CHUNK_K, CHUNK_K)
    amax = np.abs(xc).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    codes = np.clip(np.rint(xc * inv[:, :, None]), -127, 127).astype(np.int8)
    scales = (amax / np.float32(127.0)).astype(np.float32)
    return codes.reshape(n, kpad), scales


def dequantize_act8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    n, kpad = codes.shape
    return (codes.reshape(n, -1, CHUNK_K).astype(np.float32) * scales[:, :, None]).reshape(n, kpad)


def act8_fragment_bytes(codes: np.ndarray) -> np.ndarray:
    """Natural-order codes [n, kpad] -> the kernel's byte order (uint8, same shape)."""
    n, kpad = codes.shape
    return codes.reshape(n, -1, CHUNK_K)[:, :, act8_order()].reshape(n, kpad).view(np.uint8)


def _s8x4(word: int) -> np.ndarray:
    return np.array([word], dtype=np.uint32).view(np.int8).astype(np.int64)


def _prmt(a: int, b: int, sel: int) -> int:
    src = np.array([a, b], dtype=np.uint32).view(np.uint8)
    return int(np.array([src[(sel >> (4 * i)) & 7] for i in range(4)], dtype=np.uint8).view(np.uint32)[0])


def emulate_a8_chunk(codes: np.ndarray, shape: MatrixShape, tile: int, chunk: int, xbytes: np.ndarray) -> np.ndarray:
    """One (16-row tile, 64-k chunk) of the a8 GEMV, done the way the kernel does it: weight words
    unpacked by the same bit operations (q4: nibble -> byte x 16; q8: byte permutes), the 8 lanes'
    activation bytes (xbytes [8, 64], act8_fragment_bytes order) loaded as B fragments, and
    mma.m16n8k32 s8 per the PTX fragment maps. Returns the exact int32 sums [16 rows, 8 lanes]
    (q4 sums carry the factor 16)."""
    cb = CHUNK_BYTES[shape.fmt]
    words = codes[(tile * shape.kchunks + chunk) * cb: (tile * shape.kchunks + chunk + 1) * cb].view(np.uint32)
    xw = np.ascontiguousarray(xbytes, dtype=np.uint8).view(np.uint32)  # [8, 16] words
    d = np.zeros((16, 8), dtype=np.int64)
    for b in range(2):  # k32 steps of the chunk
        A = np.zeros((16, 32), dtype=np.int64)  # the mma's own (row, k) view
        B = np.zeros((32, 8), dtype=np.int64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            if shape.fmt == FMT_Q4:
                w0, w1 = int(words[lane * 4 + 2 * b]), int(words[lane * 4 + 2 * b + 1])
                lo8 = lambda w: ((w << 4) & 0xF0F0F0F0) ^ 0x80808080  # noqa: E731
                hi8 = lambda w: (w & 0xF0F0F0F0) ^ 0x80808080  # noqa: E731
                regs = [lo8(w0), hi8(w0), lo8(w1), hi8(w1)]
            else:
                base = (b * 512 + lane * 16) // 4
                a0, b0, a1, b1 = (int(words[base + i]) ^ 0x80808080 for i in range(4))
                regs = [_prmt(a0, b0, 0x6240), _prmt(a0, b0, 0x7351), _prmt(a1, b1, 0x6240), _prmt(a1, b1, 0x7351)]
            # A fragment (m16n8k32, s8): a0 (g, 4t..), a1 (g+8, 4t..), a2 (g, 16+4t..), a3 (g+8, 16+4t..)
            A[g, 4 * t: 4 * t + 4] = _s8x4(regs[0])
            A[g + 8, 4 * t: 4 * t + 4] = _s8x4(regs[1])
            A[g, 16 + 4 * t: 20 + 4 * t] = _s8x4(regs[2])
            A[g + 8, 16 + 4 * t: 20 + 4 * t] = _s8x4(regs[3])
            # B fragment: b0 (k 4t.., col g), b1 (k 16+4t.., col g) = words 2b, 2b+1 of the thread's 16 bytes
            B[4 * t: 4 * t + 4, g] = _s8x4(int(xw[g, t * 4 + 2 * b]))
            B[16 + 4 * t: 20 + 4 * t, g] = _s8x4(int(xw[g, t * 4 + 2 * b + 1]))
        d += A @ B
    return d
