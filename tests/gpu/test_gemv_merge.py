"""constants GEMV_MERGE (GemvPlan._merged_kernel, cuda/gemv_wg.cu gemv8w_q4_n8_g / n8d_g / n16_g): the GDN layer's bf16
decay / beta gates launch and its q4 qkvz launch as one grid, the bf16 units on 4 warps (gemv_v1.cuh gemv_body_w4:
gemv_body's 8 warps two a warp, their partials added in the same order). The same units, so the same bits: a model of
the 27B's hidden size and heads (so qkvz streams 80 chunks a unit and takes the deep-ring entry at <= 8 lanes) decoding,
verifying (up to 16 lanes: the n16 twin) and committing, eager and as graph replays, merged against the same plans
launched apart; and the merged entry really replacing the two launches in one wave.

The plans are built with GEMV_MERGE on in both runs: it also sizes the gates' K splits to the slots qkvz leaves
(GemvPlan._fit_merge; their sums then differ from a GEMV_MERGE = 0 build's), and only the launching is switched.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.plan_rounds import heads27b, rounds

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def gemv_gates(monkeypatch):
    """GEMV_MERGE merges the in plan's bf16 gates launch into qkvz's grid; with GDN_GATES_IN_CONV (the default since
    2026-12-07) the conv computes the gates and that launch is gone, so these tests would merge nothing (the bits
    test passing vacuously, the launch count failing): they pin the GEMV's gates. NORM_FOLD takes a block of at most
    NORM_FOLD_LANES lanes of the in plan to its *_nf launch (the gates after it, unmerged): pinned off too."""
    from q27py.gpu import constants as C

    monkeypatch.setattr(C, "GDN_GATES_IN_CONV", 0)
    monkeypatch.setattr(C, "NORM_FOLD", 0)

@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("graphs", [False, True])
def test_merge_keeps_the_bits(graphs, mode, monkeypatch):
    """Mode 1 builds the plans with the gates sized for the deep entry's wave (both runs: only the launching is
    switched); mode 2 keeps the gates' splits, so its runs build with GEMV_MERGE 0 and 2 and still agree."""
    from q27py.gpu import constants as C
    from q27py.gpu import kernels as K
    from q27py.gpu.runtime import Runtime

    if not K.gemv_wgmma_supported():
        pytest.skip("no sm_90a gemv_wg build on this card")
    ids = [int(x) for x in np.random.default_rng(3).integers(0, 4096, 70)]
    sms = Runtime.get().sm_count
    got = {}
    for b in (0, mode):
        monkeypatch.setattr(C, "GEMV_MERGE", mode if mode == 1 else b)
        m = heads27b(graphs, hidden=None, seed=7)
        monkeypatch.setattr(C, "GEMV_MERGE", b)
        plan = m.layer_plans[0]["in"]
        (_f0, _d0, _m0, u0), (_f1, _d1, _m1, u1) = plan.launches
        one = plan._merged_kernel(1, True, False)
        if mode == 1:  # 1 lane: the deep-ring twin on a card of >= 128 SMs (qkvz's 256 units and 8 of the gates'
            assert u0 + u1 <= K.gemv_wg_ctas(8, u1, plan.unit_chunks[1]) * sms  # in one wave of 2 an SM); 16: n16's
            assert (one in ("gemv8w_q4_n8d_g", "gemv8w_q4_n8_g")) == bool(b)
            assert (plan._merged_kernel(16, True, False) == "gemv8w_q4_n16_g") == bool(b and sms >= 128)
        else:  # 276 units: the plain 8-lane twin (3 an SM); at 16 lanes no twin fits one wave where qkvz fills two an SM
            assert (one == "gemv8w_q4_n8_g") == bool(b and u0 + u1 <= C.GWG_CTAS_N8 * sms)
            assert b == 0 or u0 + u1 <= 2 * sms or plan._merged_kernel(16, True, False) is None
        assert m.layer_plans[3]["in"]._merged_kernel(1, True, False) is None  # attention's q8 kv: not bf16
        assert m.layer_plans[0]["up"]._merged_kernel(1, True, False) is None
        got[b] = rounds(m, ids, widths=(3, 7, 11, 15))  # 4 .. 16 lanes: the 8- and 16-lane twins
    for a, c in zip(got[0], got[mode]):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("mode", [1, 2])
def test_merged_entry_replaces_both_launches(mode, monkeypatch):
    from q27py.gpu import constants as C
    from q27py.gpu import kernels as K
    from q27py.gpu.runtime import Runtime

    if not K.gemv_wgmma_supported():
        pytest.skip("no sm_90a gemv_wg build on this card")
    rt = Runtime.get()
    counts = {}
    for b in (0, 1):
        monkeypatch.setattr(C, "GEMV_MERGE", mode * b)
        m = heads27b(False, hidden=None, seed=7)
        st = m.new_state()
        m.forward(st, [1, 2, 3], logits_rows="last")
        with rt.count_launches() as dec:
            m.forward(st, [4])
        counts[b] = dec
    gdn_layers = 3

    def merged(c):
        return sum(v for (mod, k), v in c.items() if mod == "gemv_wg" and k.endswith("_g"))

    assert merged(counts[1]) == gdn_layers and merged(counts[0]) == 0
    assert counts[0][("gemv", "gemv_bf16_nt1")] - counts[1][("gemv", "gemv_bf16_nt1")] == gdn_layers
    assert sum(counts[0].values()) - sum(counts[1].values()) == gdn_layers
