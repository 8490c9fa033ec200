"""CPU checks of the next-launch L2 prefetch plan (q27py/gpu/kernels.py prefetch_ranges /
prefetch_words / link_prefetch; the kernel side is cuda/gemv.cu gemv_prefetch). No GPU needed:
descriptors are numpy rows, and a fake runtime stands in for CuPy where a device array is made.
The GPU test at the end checks that a prefetching launch writes the same bits."""

from __future__ import annotations

import numpy as np
import pytest

from q27py.gpu import constants as C
from q27py.gpu import kernels as K
from q27py.gpu import layout as L

SLOTS = K.gemv_slots(132)


def desc_rows(mats) -> np.ndarray:
    """One launch's descriptor rows for (address, row groups, splits, kchunks, row tiles)."""
    d = np.zeros((len(mats), C.D_NFIELDS), dtype=np.int64)
    cta = 0
    for r, (w, rg, s, kch, rt) in enumerate(mats):
        d[r, C.D_W], d[r, C.D_RG], d[r, C.D_SPLITS], d[r, C.D_KCH], d[r, C.D_RT] = w, rg, s, kch, rt
        d[r, C.D_CTA0] = cta
        cta += rg * s
    return d


def launch(fmt, mats):
    d = desc_rows(mats)
    return (fmt, d, int(sum(rg * s for _, rg, s, _, _ in mats)))


CB4 = L.CHUNK_BYTES[L.FMT_Q4]
GATE_UP = launch(L.FMT_Q4, [(1 << 32, 544, 1, 80, 2176)])  # 34816 x 5120: 2.06 waves of CTAs
DOWN = launch(L.FMT_Q4, [(1 << 34, 80, 3, 272, 320)])  # 5120 x 17408, three K splits


def test_ranges_cover_the_first_wave_tiles_from_their_first_chunk():
    budget = 16 << 20
    rs = K.prefetch_ranges([GATE_UP], budget, SLOTS)
    tiles = SLOTS * C.GEMV_R  # only the units that start first (CTAs 0..SLOTS-1)
    assert len(rs) == tiles
    k = int(budget / tiles // CB4)
    tstride = 80 * CB4
    assert [a for a, _ in rs] == [(1 << 32) + t * tstride for t in range(tiles)]  # each tile's chunk 0
    assert all(nb == k * CB4 for _, nb in rs)
    assert sum(nb for _, nb in rs) <= budget


def test_split_units_start_at_their_split_and_stay_inside_it():
    rs = K.prefetch_ranges([DOWN], 1 << 40, SLOTS)  # a budget past everything: each split's whole range
    assert len(rs) == 80 * 3 * C.GEMV_R  # 240 units < SLOTS: all of them
    tstride = 272 * CB4
    want = []
    for v in range(240):
        rg, sp = divmod(v, 3)
        c0, c1 = sp * 272 // 3, (sp + 1) * 272 // 3
        for i in range(C.GEMV_R):
            want.append(((1 << 34) + (rg * 4 + i) * tstride + c0 * CB4, (c1 - c0) * CB4))
    assert rs == want


def test_missing_tiles_budget_zero_and_range_cap():
    # 96 rows = 6 row tiles in 2 row groups: the second group's last two tiles do not exist
    small = launch(L.FMT_BF16, [(1 << 30, 2, 1, 80, 6)])
    rs = K.prefetch_ranges([small], 1 << 30, SLOTS)
    assert len(rs) == 6
    assert K.prefetch_ranges([small], 0, SLOTS) == []
    huge = launch(L.FMT_Q4, [(1 << 33, 1, 1, 4096, 4)])  # 2 MiB per tile: capped at one range word's 1 MiB
    assert all(nb == K.PF_MAX_UNITS16 * 16 // CB4 * CB4 for _, nb in K.prefetch_ranges([huge], 1 << 40, SLOTS))


def test_words_go_to_the_last_wave_once_each_and_decode_back():
    rs = K.prefetch_ranges([DOWN], 16 << 20, SLOTS)
    units = 544  # the gate_up launch before it
    w = K.prefetch_words(rs, units, SLOTS)
    assert w.shape == (units, C.GEMV_PF_PER) and w.dtype == np.uint64
    first = units - SLOTS
    assert not w[:first].any(), "CTAs of the earlier waves prefetch nothing"
    got = sorted((int(x) & (1 << 48) - 1, (int(x) >> 48) * 16) for x in w.ravel() if x)
    assert got == sorted(rs)
    per_cta = (w[first:] != 0).sum(axis=1)
    assert per_cta.max() - per_cta.min() <= 1, "dealt evenly over the issuers"
    # more ranges than the last wave can carry: the excess is dropped, never wrapped onto a CTA twice
    many = [(16 * (i + 1), 16) for i in range(SLOTS * C.GEMV_PF_PER + 50)]
    w2 = K.prefetch_words(many, 10, SLOTS)  # a 10-CTA launch: all of it is the last wave
    kept = sorted(int(x) & (1 << 48) - 1 for x in w2.ravel())
    assert kept == [a for a, _ in many[: 10 * C.GEMV_PF_PER]]


class _Dev:
    """A device array stand-in: set() overwrites in place (what a captured graph relies on)."""

    def __init__(self, a):
        self.a = np.array(a)

    def set(self, a):
        self.a[...] = a


class _FakeRt:
    sm_count = 132
    l2_bytes = 60 << 20

    class cp:
        asarray = staticmethod(_Dev)


class _Plan:
    def __init__(self, tag, launches, impl="a8"):
        self.tag, self.desc_host, self.impl, self.pf = tag, launches, impl, None


def test_link_prefetch_chains_in_order_and_relinks_in_place(monkeypatch):
    monkeypatch.setattr(K.Runtime, "get", classmethod(lambda cls: _FakeRt()))
    a = _Plan("a", [GATE_UP])
    b = _Plan("b", [DOWN])
    c = _Plan("c", [launch(L.FMT_Q4, [(1 << 35, 256, 1, 80, 1024)])])
    K.link_prefetch([a, b, c], 8 << 20)
    for p, nxt in ((a, b), (b, c), (c, a)):  # cyclic: the last plan prefetches the first
        addrs = {int(x) & (1 << 48) - 1 for x in p.pf.a.ravel() if x}
        starts = {r[0] for r in K.prefetch_ranges(nxt.desc_host, 8 << 20, SLOTS)}
        assert addrs == starts, (p.tag, nxt.tag)
    arr = a.pf
    K.link_prefetch([a, b, c], 0)
    assert a.pf is arr and not a.pf.a.any(), "budget 0 clears the words in place"
    d = _Plan("d", [DOWN])
    K.link_prefetch([d, a], 8 << 20, cyclic=False)
    assert d.pf is not None and a.pf is arr and not a.pf.a.any(), "non-cyclic leaves the last plan alone"
    v2 = _Plan("v2", [DOWN], impl="v2")
    K.link_prefetch([v2, a], 8 << 20, cyclic=False)
    assert v2.pf is None, "v2 kernels take no prefetch list"


def test_budget_is_capped_by_the_l2():
    assert K.prefetch_budget_bytes(16, 60 << 20) == 16 << 20
    assert K.prefetch_budget_bytes(64, 6 << 20) == 2 << 20  # a 3090's 6 MB L2: a third of it
    assert K.prefetch_budget_bytes(0, 60 << 20) == 0 and K.prefetch_budget_bytes(-1, 60 << 20) == 0


def test_config_knob_maps_from_env():
    from q27py.config import Q27Config, apply_env

    assert apply_env(Q27Config(), {"Q27_GEMV_PREFETCH_MB": "0"}).engine.gemv_prefetch_mb == 0.0
    assert apply_env(Q27Config(), {"Q27_GEMV_PREFETCH_MB": "8"}).engine.gemv_prefetch_mb == 8.0


def test_kernel_word_layout_matches_the_host():
    """cuda/gemv.cu (its unit in gemv_v1.cuh) decodes the words the way prefetch_words packs them (address bits
    0..47, 16-byte units above), per CTA row of GEMV_PF_PER."""
    from q27py.gpu.runtime import source_text

    src = source_text("gemv")  # gemv.cu with its headers spliced in, as NVRTC compiles it
    body = src[src.index("void gemv_prefetch("):]
    body = body[: body.index("\n}\n")]
    assert body.count("0xFFFFFFFFFFFFull") == 2 and body.count(">> 48) * 16u") == 2
    assert "pf + (i64)u * GEMV_PF_PER + lane" in src


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["a8", "v1"])
def test_prefetching_launches_write_the_same_bits(cp, impl):
    """A chain of plans linked for the prefetch (budget past every range) gives bit-identical outputs
    to the same chain unlinked, at 1, 8 and 16 lanes (a hint must never touch the math)."""
    rng = np.random.default_rng(3)
    shapes = [(1024, 2048, L.FMT_Q4), (2048, 1024, L.FMT_Q8), (96, 2048, L.FMT_BF16), (3000, 2048, L.FMT_Q4)]
    mats = [K.random_matrix(r, c, f, seed=i, scale=0.02) for i, (r, c, f) in enumerate(shapes)]
    ws = K.Workspace()
    ys = [cp.zeros((16, r), dtype=cp.float32) for r, _, _ in shapes]
    plans = [K.GemvPlan([m], [(y, m.shape.rows)], ws, impl=impl) for m, y in zip(mats, ys)]
    xs = [cp.asarray(np.pad(rng.standard_normal((16, c)).astype(np.float32), ((0, 0), (0, m.shape.kpad - c))))
          for m, (_, c, _) in zip(mats, shapes)]
    outs = {}
    for budget in (0, 1 << 30):
        K.link_prefetch(plans, budget)
        assert all((p.pf is not None and bool(p.pf.any())) == (budget > 0) for p in plans if p.pf is not None)
        for n in (1, 8, 16):
            for p, x, m in zip(plans, xs, mats):
                p.run(x, m.shape.kpad, n)
            cp.cuda.get_current_stream().synchronize()
            outs[(budget, n)] = [y[:n].get() for y in ys]
    for n in (1, 8, 16):
        for a, b in zip(outs[(0, n)], outs[(1 << 30, n)]):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), n
