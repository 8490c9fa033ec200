"""CPU check of cuda/dequant.cu's index math: the per-thread loops of dequant_q4 / q8 / bf16,
written out in numpy exactly as the kernel walks them, must rebuild layout.unpack's matrix
(rounded to bf16) from the packed bytes. Catches a wrong fragment formula without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from q27py.gpu import layout as L


def emulate_dequant(pm: L.PackedMatrix) -> np.ndarray:
    sh = pm.shape
    out = np.full((sh.row_tiles * 16, sh.kpad), np.nan, dtype=np.float32)
    words = pm.codes.view(np.uint32)
    if sh.fmt != L.FMT_BF16:
        pairs = pm.scales.reshape(sh.row_tiles, sh.groups, 8)
    for tile in range(sh.row_tiles):
        for chunk in range(sh.kchunks):
            b = tile * sh.kchunks + chunk
            for lane in range(32):
                g, t = lane // 4, lane % 4
                if sh.fmt != L.FMT_BF16:
                    pair = int(pairs[tile, chunk // sh.group_chunks, g])
                    s_lo = np.float32(np.uint16(pair & 0xFFFF).view(np.float16))
                    s_hi = np.float32(np.uint16(pair >> 16).view(np.float16))
                vals = {}
                if sh.fmt == L.FMT_Q4:
                    w = words[(b * 512 + lane * 16) // 4:][:4]
                    for st in range(4):
                        for q in range(8):
                            p, e = q & 3, q >> 2
                            row, k = g + 8 * (p & 1), 16 * st + 2 * t + 8 * (p >> 1) + e
                            c = np.float32(int((int(w[st]) >> (4 * q)) & 15) - 8)
                            vals[row, k] = c * (s_lo if row < 8 else s_hi)
                elif sh.fmt == L.FMT_Q8:
                    for jj in range(2):
                        w = words[(b * 1024 + jj * 512 + lane * 16) // 4:][:4]
                        for wi in range(4):
                            step, word = 2 * jj + (wi >> 1), wi & 1
                            for bb in range(4):
                                row, k = g + 8 * (bb & 1), 16 * step + 2 * t + 8 * word + (bb >> 1)
                                c = np.float32(int((int(w[wi]) >> (8 * bb)) & 255) - 128)
                                vals[row, k] = c * (s_lo if row < 8 else s_hi)
                else:
                    for st in range(4):
                        w = words[(b * 2048 + st * 512 + lane * 16) // 4:][:4]
                        for reg in range(4):
                            row, k = g + 8 * (reg & 1), 16 * st + 2 * t + 8 * (reg >> 1)
                            vals[row, k] = L.bf16_to_f32(np.array([int(w[reg]) & 0xFFFF], np.uint16))[0]
                            vals[row, k + 1] = L.bf16_to_f32(np.array([int(w[reg]) >> 16], np.uint16))[0]
                for (row, k), v in vals.items():
                    out[tile * 16 + row, chunk * 64 + k] = L.bf16_to_f32(L.bf16_bits(np.array([v], np.float32)))[0]
    return out


@pytest.mark.parametrize("fmt", [L.FMT_BF16, L.FMT_Q8, L.FMT_Q4])
def test_dequant_index_math_rebuilds_the_matrix(fmt):
    rng = np.random.default_rng(40 + fmt)
    rows, cols = 21, 200  # ragged rows (padded tile) and k (padded chunk); q8 groups span 2 chunks
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    pm = L.pack_matrix(w, fmt)
    got = emulate_dequant(pm)
    assert not np.isnan(got).any(), "every element of every block is written"
    want = L.bf16_to_f32(L.bf16_bits(L.unpack(pm)))
    np.testing.assert_array_equal(got[:rows, :cols], want)
    assert not got[rows:].any() and not got[:, cols:].any(), "padding decodes to zero"
