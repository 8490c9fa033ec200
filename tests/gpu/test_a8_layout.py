"""The a8 GEMV's activation layout and unpack arithmetic, emulated on the CPU (no GPU needed):
the kernel's bit operations on the real packed bytes, paired through the mma.m16n8k32 fragment
maps with quantize_act8's bytes, must give exactly the integer dot products of the codes."""

from __future__ import annotations

import numpy as np
import pytest

from q27py.gpu import layout as L


def test_act8_order_is_a_permutation_matching_the_weight_k_slots():
    order = L.act8_order()
    assert sorted(order.tolist()) == list(range(64))
    # thread t's 16 bytes cover exactly the k slots its weights use in the q4 layout
    rows, ks = L.FRAGMENT_MAPS[L.FMT_Q4]
    for t in range(4):
        lane = t  # g = 0
        mine = set(ks[lane * 32:(lane + 1) * 32].tolist())
        assert set(order[t * 16:(t + 1) * 16].tolist()) == mine


def test_quantize_act8_round_trip_and_zero_chunks():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 192)).astype(np.float32)
    x[1, 64:128] = 0.0
    codes, scales = L.quantize_act8(x)
    assert codes.dtype == np.int8 and np.abs(codes).max() == 127
    assert scales[1, 1] == 0.0 and not codes[1, 64:128].any()
    back = L.dequantize_act8(codes, scales)
    err = np.abs(back - x).reshape(3, 3, 64).max(axis=2)
    assert (err <= scales * 0.5 + 1e-12).all()


@pytest.mark.parametrize("fmt", [L.FMT_Q4, L.FMT_Q8])
def test_a8_chunk_emulation_gives_exact_integer_dots(fmt):
    rng = np.random.default_rng(fmt)
    w = rng.standard_normal((16, 128)).astype(np.float32)
    pm = L.pack_matrix(w, fmt)
    codes_w, _ = L.quantize(w, fmt)
    x = rng.standard_normal((8, 128)).astype(np.float32) * 3
    xc, _ = L.quantize_act8(x)
    xb = L.act8_fragment_bytes(xc)
    mult = 16 if fmt == L.FMT_Q4 else 1
    for chunk in range(2):
        got = L.emulate_a8_chunk(pm.codes, pm.shape, 0, chunk, xb[:, chunk * 64:(chunk + 1) * 64])
        ref = codes_w[:, chunk * 64:(chunk + 1) * 64].astype(np.int64) @ xc[:, chunk * 64:(chunk + 1) * 64].astype(np.int64).T
        np.testing.assert_array_equal(got, mult * ref)
