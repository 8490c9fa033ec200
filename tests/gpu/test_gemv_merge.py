"""constants GEMV_MERGE (GemvPlan._merged_kernel, cuda/gemv_wg.cu gemv8w_q4_n8_g / n8d_g / n16_g): the GDN layer's bf16
decay / beta gates launch and its q4 qkvz launch as one grid, the bf16 units on 4 warps (gemv_v1.cuh gemv_body_w4:
gemv_body's 8 warps two a warp, their partials added in the same order). The same units, so the same bits: a model of
the 27B's hidden size and heads (so qkvz streams 80 chunks a unit and takes the deep-ring entry at <= 8 lanes) decoding,
verifying (up to 16 lanes: the n16 twin) and committing, eager and as graph replays, merge on against off; and the
merged entry really replacing the two launches.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.plan_rounds import heads27b, rounds

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("graphs", [False, True])
def test_merge_keeps_the_bits(graphs, monkeypatch):
    from q27py.gpu import constants as C
    from q27py.gpu import kernels as K
    from q27py.gpu.runtime import Runtime

    if not K.gemv_wgmma_supported():
        pytest.skip("no sm_90a gemv_wg build on this card")
    ids = [int(x) for x in np.random.default_rng(3).integers(0, 4096, 70)]
    got = {}
    for b in (0, 1):
        monkeypatch.setattr(C, "GEMV_MERGE", b)
        m = heads27b(graphs, hidden=None, seed=7)
        plan = m.layer_plans[0]["in"]
        # 1 lane: the deep-ring twin on a card of >= 128 SMs (qkvz's 256 units in one wave of 2 an SM); 16: n16's
        assert (plan._merged_kernel(1, True, False) in ("gemv8w_q4_n8d_g", "gemv8w_q4_n8_g")) == bool(b)
        assert (plan._merged_kernel(16, True, False) == "gemv8w_q4_n16_g") == bool(b and Runtime.get().sm_count >= 128)
        assert m.layer_plans[3]["in"]._merged_kernel(1, True, False) is None  # attention's q8 kv: not bf16
        assert m.layer_plans[0]["up"]._merged_kernel(1, True, False) is None
        got[b] = rounds(m, ids, widths=(3, 7, 11, 15))  # 4 .. 16 lanes: the n8d and n16 twins
    for a, c in zip(got[0], got[1]):
        np.testing.assert_array_equal(a, c)


def test_merged_entry_replaces_both_launches(monkeypatch):
    from q27py.gpu import constants as C
    from q27py.gpu import kernels as K
    from q27py.gpu.runtime import Runtime

    if not K.gemv_wgmma_supported():
        pytest.skip("no sm_90a gemv_wg build on this card")
    rt = Runtime.get()
    counts = {}
    for b in (0, 1):
        monkeypatch.setattr(C, "GEMV_MERGE", b)
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
