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


# ---------------------------------------------------------------- the a8 persistent schedule (cuda/gemv.cu gemv8_body)
def _start(c, ctas, items):
    return c * items // ctas


def _cta_of(i, ctas, items):
    c = i * ctas // items
    while c + 1 < ctas and _start(c + 1, ctas, items) <= i:
        c += 1
    while c > 0 and _start(c, ctas, items) > i:
        c -= 1
    return c


@pytest.mark.parametrize("row_groups,kch,ctas", [(544, 80, 264), (80, 96, 264), (32, 80, 160), (3880, 80, 264),
                                                 (1, 272, 17), (7, 3, 5), (2, 80, 264)])
def test_a8_schedule_covers_every_item_once_and_partials_do_not_collide(row_groups, kch, ctas):
    """Mirror of the kernel's index math: every (row group, chunk) item is computed by exactly one
    (CTA, warp); a row group split between CTAs gets one partial per CTA in distinct (CTA, slot)
    places, and the last CTA's sum (CTAs c_first..c_last) reads exactly those."""
    from q27py.gpu import constants as C

    items = row_groups * kch
    ctas = max(1, min(ctas, items // C.A8_MIN_ITEMS)) if items >= C.A8_MIN_ITEMS else 1
    seen = np.zeros(items, dtype=np.int64)
    writers: dict[int, set] = {}
    for c in range(ctas):
        i0, i1 = _start(c, ctas, items), _start(c + 1, ctas, items)
        if i1 <= i0:
            continue
        slots = set()
        for rg in range(i0 // kch, (i1 - 1) // kch + 1):
            lo = i0 - rg * kch if rg == i0 // kch else 0
            hi = i1 - rg * kch if rg == (i1 - 1) // kch else kch
            for w in range(C.GEMV_WARPS):
                for ch in range(lo + w, hi, C.GEMV_WARPS):
                    seen[rg * kch + ch] += 1
            slot = 0 if rg == i0 // kch else 1
            c_first, c_last = _cta_of(rg * kch, ctas, items), _cta_of(rg * kch + kch - 1, ctas, items)
            assert c_first <= c <= c_last
            if c_first != c_last:
                assert slot not in slots
                slots.add(slot)
                writers.setdefault(rg, set()).add((c, slot))
    assert (seen == 1).all()
    for rg, ws in writers.items():
        c_first, c_last = _cta_of(rg * kch, ctas, items), _cta_of(rg * kch + kch - 1, ctas, items)
        reads = {(cc, 0 if rg == _start(cc, ctas, items) // kch else 1) for cc in range(c_first, c_last + 1)}
        assert reads == ws, rg
