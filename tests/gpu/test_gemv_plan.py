"""CPU checks of the GEMV planning (no GPU): the v2 partition model and the implementation switch."""

from __future__ import annotations

import pytest

from q27py.config import Q27Config, apply_env
from q27py.gpu import constants as C
from q27py.gpu import kernels as K
from q27py.gpu import layout as L

# (rows, cols, fmt) of the 27B launches (q4s tier) and a few small / odd ones
SHAPES = [(34816, 5120, L.FMT_Q4), (5120, 17408, L.FMT_Q4), (16384, 5120, L.FMT_Q4), (96, 5120, L.FMT_BF16),
          (5120, 6144, L.FMT_Q4), (2048, 5120, L.FMT_Q8), (248320, 5120, L.FMT_Q4), (64, 8192, L.FMT_Q4),
          (37, 200, L.FMT_Q8), (1040, 256, L.FMT_BF16)]


@pytest.mark.parametrize("sms", [132, 82, 170, 28])
@pytest.mark.parametrize("rows,cols,fmt", SHAPES)
def test_v2_partition_is_valid_and_keeps_warps_busy(rows, cols, fmt, sms):
    sh = L.matrix_shape(rows, cols, fmt)
    rg = sh.row_tiles // C.GEMV_R
    rgb, splits = K.choose_partition(rg, sh.kchunks, sms, fmt)
    assert rgb in (1, 2, 4) and C.G2_WARPS % rgb == 0
    assert rgb <= max(rg, 1) or rgb == 1, "a CTA never owns more row groups than exist"
    kw = C.G2_WARPS // rgb
    assert 1 <= splits <= max(1, sh.kchunks // (kw * K.G2_MIN_CHUNKS)), "every warp keeps >= G2_MIN_CHUNKS chunks"
    assert K.choose_partition(rg, sh.kchunks, sms, fmt) == (rgb, splits)  # a pure function of the shape


def test_v2_partition_fills_the_h200_on_the_27b_shapes():
    """The model's purpose: every large 27B launch gets at least one wave of resident CTAs, or as
    many as the per-warp minimum of chunks allows (k/v: 10 MB over 32 row groups)."""
    slots = C.G2_CTAS_NT1 * 132
    for rows, cols, fmt in SHAPES[:7]:
        sh = L.matrix_shape(rows, cols, fmt)
        rg = sh.row_tiles // C.GEMV_R
        rgb, splits = K.choose_partition(rg, sh.kchunks, 132, fmt)
        units = -(-rg // rgb) * splits
        most = max(-(-rg // r) * max(1, sh.kchunks // (C.G2_WARPS // r * K.G2_MIN_CHUNKS)) for r in (1, 2, 4))
        if sh.code_bytes > 8 << 20:
            assert units >= min(0.9 * slots, 0.6 * most), (rows, cols, rgb, splits, units)


def test_gemv_impl_comes_from_the_config(monkeypatch):
    assert apply_env(Q27Config(), {"Q27_GEMV": "v2"}).engine.gemv == "v2"
    assert Q27Config().engine.gemv in K.GEMV_IMPLS
    old = K._GEMV_IMPL
    try:
        K._GEMV_IMPL = None
        monkeypatch.setenv("Q27_GEMV", "v2")
        assert K.gemv_impl() == "v2"
        with pytest.raises(ValueError, match="unknown GEMV implementation"):
            K.set_gemv_impl("v3")
    finally:
        K._GEMV_IMPL = old


@pytest.mark.parametrize("sms", [132, 82, 170, 28])
@pytest.mark.parametrize("rows,cols,fmt", SHAPES)
def test_tail_split_pieces_cover_the_matrix_and_fill_the_last_wave(rows, cols, fmt, sms, monkeypatch):
    monkeypatch.setattr(C, "GEMV_TAIL_SPLIT", 1)
    sh = L.matrix_shape(rows, cols, fmt)
    rg = sh.row_tiles // C.GEMV_R
    splits = K.choose_splits(rg, sh.kchunks, sms)
    pieces = K.tail_split(rg, sh.kchunks, splits, sms)
    assert pieces[0][0] == 0 and sum(n for _, n, _ in pieces) == rg
    assert all(a + n == b for (a, n, _), (b, _, _) in zip(pieces, pieces[1:])), "contiguous, in order"
    slots = K.gemv_slots(sms)
    if len(pieces) == 2:
        (_, full, s0), (_, tail, s1) = pieces
        assert s0 == 1 and full % slots == 0, "the whole waves stay whole"
        assert 2 <= s1 <= sh.kchunks // C.GEMV_WARPS and tail * s1 <= slots, "the tail fits one wave, a chunk per warp"
    monkeypatch.setattr(C, "GEMV_TAIL_SPLIT", 0)
    assert K.tail_split(rg, sh.kchunks, splits, sms) == [(0, rg, splits)]


def test_tail_split_takes_gate_ups_third_wave(monkeypatch):
    """The 27B's gate_up (544 row groups, 80 chunks) on an H200 (264 slots): 528 whole + 16 x 10 splits
    when on; off by default, every matrix stays whole."""
    assert K.tail_split(544, 80, 1, 132) == [(0, 544, 1)]
    monkeypatch.setattr(C, "GEMV_TAIL_SPLIT", 1)
    assert K.tail_split(544, 80, 1, 132) == [(0, 528, 1), (528, 16, 10)]
    assert K.tail_split(3880, 80, 1, 132) == [(0, 3880, 1)]  # lm_head: a thick last wave (184 of 264)


@pytest.mark.parametrize("ctas", [2, 3, 4])
@pytest.mark.parametrize("sms", [132, 82, 170, 28])
@pytest.mark.parametrize("rows,cols,fmt", SHAPES)
def test_splits_sized_for_resident_ctas_never_overrun_one_wave(rows, cols, fmt, sms, ctas):
    """choose_splits(..., ctas_per_sm): the most splits whose units fit one wave of that many CTAs an SM (a
    matrix of more row groups than slots keeps one split), every warp keeping >= 1 chunk a residue; a pure
    function of the shape and the card (the lane count never enters)."""
    sh = L.matrix_shape(rows, cols, fmt)
    rg = sh.row_tiles // C.GEMV_R
    s = K.choose_splits(rg, sh.kchunks, sms, ctas)
    slots = ctas * sms
    assert 1 <= s <= max(1, sh.kchunks // 8)
    if s > 1:
        assert rg * s <= slots, "one wave at most"
    if s < sh.kchunks // 8:
        assert rg * (s + 1) > slots, "no further split would still fit the wave"


def test_splits_for_gemv_wg_fill_its_three_ctas_on_the_27b_shapes():
    """The 80-row-group launches (down, gdn_out, attn_o) run 240 units under the 2-CTA rule but 320 of gemv_wg's
    396 slots when sized for 3 CTAs an SM; round() would have given 5 splits (400 units: 4 past the wave)."""
    assert K.choose_splits(80, 272, 132) == 3 and K.choose_splits(80, 96, 132) == 3
    assert K.choose_splits(80, 272, 132, 3) == 4 and K.choose_splits(80, 96, 132, 3) == 4
    assert K.choose_splits(192, 80, 132, 3) == 2  # attn_in's q + gate: 384 units
    assert K.choose_splits(544, 80, 132, 3) == 1 and K.choose_splits(3880, 80, 132, 3) == 1


def test_split_ctas_per_sm_is_off_unless_asked_and_only_for_a8_q4(monkeypatch):
    """GEMV_SPLIT_CTAS = 0 keeps the old rule everywhere; set, it applies to a8 q4 matrices only on a card with
    gemv_wg's sm_90a build (bf16 / q8 matrices and the v1 / v2 plans keep theirs). GEMV_TAIL_CTAS (default 3) is
    the tail split's own, on the same terms."""
    assert C.GEMV_SPLIT_CTAS == 0 and C.GEMV_TAIL_CTAS == 3  # the shipped defaults (docs/PERF.md)
    monkeypatch.setattr(C, "GEMV_SPLIT_CTAS", 0)
    assert K.split_ctas_per_sm("a8", L.FMT_Q4) == 0
    monkeypatch.setattr(C, "GEMV_SPLIT_CTAS", 3)
    monkeypatch.setattr(K, "gemv_wgmma_supported", lambda *a, **k: True)
    assert K.split_ctas_per_sm("a8", L.FMT_Q4) == 3
    assert K.split_ctas_per_sm("a8", L.FMT_Q8) == 0 and K.split_ctas_per_sm("a8", L.FMT_BF16) == 0
    assert K.split_ctas_per_sm("v1", L.FMT_Q4) == 0 and K.split_ctas_per_sm("v2", L.FMT_Q4) == 0
    monkeypatch.setattr(C, "GEMV_TAIL_CTAS", 0)
    assert K.split_ctas_per_sm("a8", L.FMT_Q4, tail=True) == 0
    monkeypatch.setattr(C, "GEMV_TAIL_CTAS", 3)
    monkeypatch.setattr(C, "GEMV_SPLIT_CTAS", 0)
    assert K.split_ctas_per_sm("a8", L.FMT_Q4, tail=True) == 3 and K.split_ctas_per_sm("a8", L.FMT_Q4) == 0
    assert K.split_ctas_per_sm("a8", L.FMT_Q8, tail=True) == 0
    monkeypatch.setattr(K, "gemv_wgmma_supported", lambda *a, **k: False)
    assert K.split_ctas_per_sm("a8", L.FMT_Q4) == 0 and K.split_ctas_per_sm("a8", L.FMT_Q4, tail=True) == 0


def test_tail_split_on_gemv_wg_slots_halves_gate_ups_second_wave(monkeypatch):
    """Sized for 3 CTAs an SM (396 slots), gate_up's 544 row groups are one whole wave of 396 and 148 row groups
    split in two (296 half units fill the slots the first wave frees); lm_head's remainder (316) cannot split
    in two within a wave and stays whole."""
    monkeypatch.setattr(C, "GEMV_TAIL_SPLIT", 0)  # sized for gemv_wg's slots, the split is on whatever this says
    assert K.tail_split(544, 80, 1, 132, 3) == [(0, 396, 1), (396, 148, 2)]
    assert K.tail_split(544, 80, 1, 132) == [(0, 544, 1)]  # the 2-CTA rule stays off
    monkeypatch.setattr(C, "GEMV_TAIL_SPLIT", 1)
    assert K.tail_split(544, 80, 1, 132, 3) == [(0, 396, 1), (396, 148, 2)]
    assert K.tail_split(3880, 80, 1, 132, 3) == [(0, 3880, 1)]
    assert K.tail_split(320, 80, 1, 132, 3) == [(0, 320, 1)]  # fits one wave


@pytest.mark.parametrize("sms", [132, 114, 170, 28])
def test_merge_splits_fit_the_gates_beside_qkvz_in_one_wave(sms):
    """GEMV_MERGE's sizing (kernels.merge_splits): the 27B GDN layer's bf16 decay / beta gates (96 rows of 5,120: two
    row groups, choose_splits' splits) beside qkvz's units fill at most the slots of 2 CTAs an SM, taking as many
    splits as fit and never more than they had; where not even one split each fits, nothing changes."""
    sh = L.matrix_shape(96, 5120, L.FMT_BF16)
    splits = K.choose_splits(sh.row_tiles // C.GEMV_R, sh.kchunks, sms)
    q4 = L.matrix_shape(16384, 5120, L.FMT_Q4)
    qkvz = (q4.row_tiles // C.GEMV_R) * K.choose_splits(q4.row_tiles // C.GEMV_R, q4.kchunks, sms)
    slots = 2 * sms
    s = K.merge_splits(2, splits, qkvz, slots)
    assert 1 <= s <= splits
    if slots - qkvz >= 2:
        assert qkvz + 2 * s <= slots and (s == splits or qkvz + 2 * (s + 1) > slots)
    else:
        assert s == splits
    # the H100 / H200 case: 256 qkvz units on 264 slots leave 8, four splits a row group (was 10: a second wave)
    assert K.merge_splits(2, 10, 256, 264) == 4
    assert K.merge_splits(2, 10, 263, 264) == 10 and K.merge_splits(2, 3, 200, 264) == 3


def test_split_max_kch_limits_the_split_rule_to_short_matrices(monkeypatch):
    """GEMV_SPLIT_MAX_KCH (0 by default: every matrix) keeps GEMV_SPLIT_CTAS to the matrices of at most that many
    chunks of K -- at 96, the 27B's gdn_out / attn_o (96) and attention's q (80) but not down (272) -- and never
    touches the tail split's rule."""
    assert C.GEMV_SPLIT_MAX_KCH == 0
    monkeypatch.setattr(K, "gemv_wgmma_supported", lambda *a, **k: True)
    monkeypatch.setattr(C, "GEMV_SPLIT_CTAS", 3)
    assert K.split_ctas_per_sm("a8", L.FMT_Q4, kchunks=272) == 3  # 0: no limit
    monkeypatch.setattr(C, "GEMV_SPLIT_MAX_KCH", 96)
    assert [K.split_ctas_per_sm("a8", L.FMT_Q4, kchunks=k) for k in (80, 96, 97, 272)] == [3, 3, 0, 0]
    assert K.split_ctas_per_sm("a8", L.FMT_Q4, tail=True, kchunks=272) == C.GEMV_TAIL_CTAS
    # what the plans get at the 27B's shapes: gdn_out 3 -> 4 splits, down keeps the old rule's 3
    assert K.choose_splits(80, 96, 132, K.split_ctas_per_sm("a8", L.FMT_Q4, kchunks=96)) == 4
    assert K.choose_splits(80, 272, 132, K.split_ctas_per_sm("a8", L.FMT_Q4, kchunks=272)) == 3
