"""constants NORM_TAIL (cuda/gemv_wg.cu's *_nt entries, wg_norm_tail; kernels.GemvPlan.set_norm_tail / _tails,
FastModel._norm): a decode / verify layer's out projection (gdn_out / attn_o, 1-8 lanes) computes the post-attention
RMSNorm in its own last CTA -- the normed rows and gate_up's a8 activations, wg_norm_fold's replay of rmsnorm_row's
order -- and the rmsnorm_rows_a8 launch before gate_up goes. Held bitwise against the norm launch: logits, states and
the normed rows over decode steps, verify rounds (past 8 lanes the launch runs) and commits, eager and under graphs,
at the 27B hidden (rmsnorm's 1,024-thread order) and below 2,048 (256 threads); the launch counts show the tail is not
vacuous; the ticket is left zero.

Device command: python3 -m pytest -q tests/gpu/test_norm_tail.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.plan_rounds import decode_counts, normed_rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("hidden", [None, 1024])
@pytest.mark.parametrize("graphs", [False, True])
def test_tail_keeps_the_bits(graphs, hidden, wg, monkeypatch):
    from q27py.gpu import constants as C
    from tests.gpu.plan_rounds import heads27b, rounds

    ids = [int(v) for v in np.random.default_rng(21).integers(0, 4096, 43)]
    got, counts, rows = {}, {}, {}
    for on in (0, 1):
        monkeypatch.setattr(C, "NORM_TAIL", on)
        m = heads27b(graphs, hidden=hidden, seed=17)
        got[on] = rounds(m, ids, widths=(1, 2, 3, 8, 12))
        counts[on] = decode_counts(m)
        rows[on] = normed_rows(m, ids[:30])
        assert not any(p["out"].tail[2].get().any() for p in m.layer_plans), "tickets left zero"
    for i, (a, b) in enumerate(zip(got[0], got[1])):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")
    np.testing.assert_array_equal(rows[0], rows[1])
    for k in (0, 1):  # the 4 layers' post-attention norms move into their out projections
        off, on = counts[0][k], counts[1][k]
        tails = sum(v for (mod, name), v in on.items() if mod == "gemv_wg" and name.endswith("_nt"))
        assert tails == 4, on
        assert off.get(("norm", "rmsnorm_rows_a8"), 0) - on.get(("norm", "rmsnorm_rows_a8"), 0) == 4
        assert sum(off.values()) - sum(on.values()) == 4


def test_tail_rules(wg, monkeypatch):
    """Off by default; past 8 lanes (or NORM_TAIL_LANES) the plain launch and the norm launch run."""
    from q27py.gpu import constants as C
    from tests.gpu.plan_rounds import heads27b

    m = heads27b(False, hidden=None, seed=3)
    out = m.layer_plans[0]["out"]
    assert C.NORM_TAIL == 0 and not out._tails(1)
    monkeypatch.setattr(C, "NORM_TAIL", 1)
    assert [out._tails(n) for n in (1, 8, 9, 16)] == [True, True, False, False]
    monkeypatch.setattr(C, "NORM_TAIL_LANES", 2)  # past NORM_TAIL_LANES the norm launch runs again
    assert [out._tails(n) for n in (1, 2, 3, 8)] == [True, True, False, False]
