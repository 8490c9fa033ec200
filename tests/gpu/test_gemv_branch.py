"""constants GEMV_BRANCH (GemvPlan.branches, Runtime.side_branch): a plan's first launch (the GDN layer's bf16 decay /
beta gates, attention's q8 kv) on a side branch beside the plan's other launches instead of ahead of them in the chain. The same kernels
with the same arguments, so the same bits: the 27B heads' q4s model (the gates bf16, as the tier keeps them) decoding,
verifying and committing, eager and as graph replays, branch on against branch off; and the branch only where it
applies (a plan of several launches, one block of at most 16 lanes).
"""

from __future__ import annotations

import types

import numpy as np
import pytest

from tests.gpu.plan_rounds import heads27b, rounds


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_branch_keeps_the_bits(graphs, monkeypatch):
    from q27py.gpu import constants as C

    ids = [int(x) for x in np.random.default_rng(1).integers(0, 4096, 70)]
    got = {}
    for b in (0, 1):
        monkeypatch.setattr(C, "GEMV_BRANCH", b)
        m = heads27b(graphs, hidden=512)
        plan = m.layer_plans[0]["in"]
        assert plan.branches(1) == bool(b) and plan.branches(16) == bool(b)
        assert not plan.branches(17) and not m.layer_plans[0]["up"].branches(1)
        assert m.layer_plans[3]["in"].branches(1) == bool(b)  # attention: kv (q8) beside q (q4)
        monkeypatch.setattr(C, "GEMV_BRANCH", 2 * b)  # 2: the bf16 gates only
        assert plan.branches(1) == bool(b) and not m.layer_plans[3]["in"].branches(1)
        monkeypatch.setattr(C, "GEMV_BRANCH", b)
        got[b] = rounds(m, ids)
    for a, c in zip(got[0], got[1]):
        np.testing.assert_array_equal(a, c)


def fake_cupy(log):
    """A cupy stand-in that logs stream and event calls: which stream each launch went to, what waits on what."""
    cur = []

    class Stream:
        def __init__(self, name="side", non_blocking=False):
            self.name = name

        def wait_event(self, ev):
            log.append(("wait", self.name, ev.name))

        def __enter__(self):
            cur.append(self)

        def __exit__(self, *a):
            cur.pop()

    class Event:
        n = 0

        def __init__(self, disable_timing=False):
            Event.n += 1
            self.name = f"ev{Event.n}"

        def record(self, st):
            log.append(("record", st.name, self.name))

    main = Stream("main")
    cuda = types.SimpleNamespace(Stream=Stream, Event=Event, get_current_stream=lambda: cur[-1] if cur else main)
    return types.SimpleNamespace(cuda=cuda)


def test_side_branch_runs_beside_the_main_launches_and_joins_at_exit():
    """The fork comes before the side's launch, the main stream's launches inside the branch wait for nothing on
    the side, and the join (main waits for the side) comes only at exit. The branch as first built joined right
    after the side's launch, so qkvz (the next main launch) waited for the gates launch: the chain it was meant
    to take away, and without PDL."""
    from q27py.gpu.runtime import Runtime

    log = []
    rt = types.SimpleNamespace(cp=fake_cupy(log), _pdl_capture=True)

    def launch(what):
        log.append(("launch", rt.cp.cuda.get_current_stream().name, what, rt._pdl_capture))

    with Runtime.side_branch(rt) as on_side:
        with on_side():
            launch("ab")
        launch("qkvz")
        launch("more")
    launch("conv")
    fork = log[0]
    assert fork[:2] == ("record", "main") and log[1] == ("wait", "side", fork[2])
    assert log[2] == ("launch", "side", "ab", False)  # the side's launches go without PDL
    assert log[3] == ("launch", "main", "qkvz", True) and log[4] == ("launch", "main", "more", True)
    join = log[5]
    assert join[:2] == ("record", "side") and log[6] == ("wait", "main", join[2])
    assert log[7] == ("launch", "main", "conv", True) and len(log) == 8
