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
    """NORM_TAIL 1 (the post-attention norms in the out projections) and 3 (also the next layer's input norm in each
    down but the last) against 0."""
    from q27py.gpu import constants as C
    from tests.gpu.plan_rounds import heads27b, rounds

    ids = [int(v) for v in np.random.default_rng(21).integers(0, 4096, 43)]
    got, counts, rows = {}, {}, {}
    for on in (0, 1, 3):
        monkeypatch.setattr(C, "NORM_TAIL", on)
        m = heads27b(graphs, hidden=hidden, seed=17)
        got[on] = rounds(m, ids, widths=(1, 2, 3, 8, 12))
        counts[on] = decode_counts(m)
        rows[on] = normed_rows(m, ids[:30])
        assert not any(p[k].tail[2].get().any() for p in m.layer_plans for k in ("out", "down") if p[k].tail), \
            "tickets left zero"
    for on in (1, 3):
        for i, (a, b) in enumerate(zip(got[0], got[on])):
            np.testing.assert_array_equal(a, b, err_msg=f"NORM_TAIL={on}: output {i}")
        np.testing.assert_array_equal(rows[0], rows[on])
        # the 4 layers' post-attention norms move into their out projections; under 3 the input norms of layers
        # 1 .. 3 into the downs before them
        want = 4 if on == 1 else 7
        for k in (0, 1):
            off, got_on = counts[0][k], counts[on][k]
            tails = sum(v for (mod, name), v in got_on.items() if mod == "gemv_wg" and name.endswith("_nt"))
            assert tails == want, got_on
            norms = [sum(v for (mod, _n), v in c.items() if mod == "norm") for c in (off, got_on)]
            assert norms[0] - norms[1] == want, (off, got_on)
            assert sum(off.values()) - sum(got_on.values()) == want


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
    down = m.layer_plans[0]["down"]  # bit 2: the next layer's input norm in down's tail; the last layer's down has none
    assert not down._tails(1) and m.layer_plans[-1]["down"].tail is None
    monkeypatch.setattr(C, "NORM_TAIL", 2)
    assert down._tails(1) and not out._tails(1)


def test_open_tail_dropped(wg, monkeypatch):
    """A tail's marker nobody took (a forward cut short after the tail launch) does not skip the next forward's norm:
    each forward drops it first (this failed before drop_open_tail: the stale marker skipped a norm launch)."""
    from q27py.gpu import constants as C
    from q27py.gpu import kernels as K
    from tests.gpu.plan_rounds import heads27b

    monkeypatch.setattr(C, "NORM_TAIL", 0)  # no tail launch in the checked forward to overwrite the stale marker
    m = heads27b(False, hidden=1024, seed=4)
    st = m.new_state()
    m.forward(st, [1, 2, 3], logits_rows="last")
    ref = m.forward(st, [4]).logits.copy()
    m.reset_state(st)
    m.forward(st, [1, 2, 3], logits_rows="last")
    up = m.layer_plans[0]["up"]
    up.norm_done = (m.w.layers[0].post_ln, 1)  # as a cut-short forward's tail launch would leave it
    K.GemvPlan._open_tail = up
    np.testing.assert_array_equal(m.forward(st, [4]).logits, ref)
    assert up.norm_done is None and K.GemvPlan._open_tail is None
