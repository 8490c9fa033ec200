"""constants GEMV_DP4A (cuda/gemv_dp.cu gemv8p_q4_*; kernels.GemvPlan._on_dp): 1-lane a8 q4 launches on the CUDA
cores, each thread streaming its fragments through a register ring and summing them with dp4a (GEMV_DP_LANES: 2-8
lanes too). Bitwise the tensor-core kernels: every plan of a 27B-shaped layer at 1-8 lanes (its outputs, the residual
adds and the SwiGLU a8 hand-over included), then logits and states over decode steps, verify rounds and commits, eager
and under graphs, at both ring depths; and the switch is not vacuous (the decode step's q4 launches move to gemv_dp).

Device command: python3 -m pytest -q tests/gpu/test_gemv_dp.py
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _plans(m):
    """(name, plan) of every GEMV plan of the model's first GDN and attention layers, and the lm_head's."""
    out = []
    for li in (0, 3):
        for key, plan in m.layer_plans[li].items():
            if hasattr(plan, "run") and hasattr(plan, "outputs"):
                out.append((f"layer{li}.{key}", plan))
    out.append(("lm_head", m.lm_plan))
    return out


def _state(plan):
    """Every buffer run() may write: the outputs, and the next plan's a8 activations when it hands them over."""
    bufs = [y for y, _ld in plan.outputs]
    nxt = getattr(plan, "quant_into", None)
    if nxt is not None:
        bufs += [nxt.xq, nxt.xs]
    return bufs


@pytest.mark.parametrize("depth, l2pf, nlanes, asyn", [(8, 0, 1, 0), (16, 0, 1, 0), (16, 48, 1, 0), (16, 0, 2, 0),
                                                       (16, 0, 3, 0), (16, 0, 4, 0), (16, 0, 5, 0), (16, 16, 8, 0),
                                                       (16, 0, 1, 1), (16, 0, 2, 1), (16, 0, 3, 1), (16, 0, 4, 1)])
def test_plans_are_bitwise_the_tensor_cores(depth, l2pf, nlanes, asyn, monkeypatch):
    """Each plan alone, its input rows random: run(nlanes) with the switch off, then (the written buffers restored) on
    (GEMV_DP_L2PF: the pre-wait L2 prefetch changes nothing but timing; 3 and 5 lanes: entries wider than the launch)."""
    import cupy as cp

    from q27py.gpu import constants as C
    from q27py.gpu.runtime import Runtime
    from tests.gpu.plan_rounds import heads27b

    monkeypatch.setattr(C, "GEMV_DP_DEPTH", depth)
    monkeypatch.setattr(C, "GEMV_DP_L2PF", l2pf)
    monkeypatch.setattr(C, "GEMV_DP_LANES", 8)
    monkeypatch.setattr(C, "GEMV_DP_ASYNC", asyn)
    m = heads27b(False, hidden=None, seed=21, intermediate=17408)
    rng = np.random.default_rng(7)
    ran = 0
    for name, plan in _plans(m):
        if not plan.a8:
            continue
        x = cp.asarray(rng.standard_normal((nlanes, plan.kpad)).astype(np.float32) * 2)
        before = [b.copy() for b in _state(plan)]
        got = []
        for on in (0, 1):
            monkeypatch.setattr(C, "GEMV_DP4A", on)
            for b, v in zip(_state(plan), before):
                b[...] = v
            with Runtime.get().count_launches() as n:
                plan.run(x, plan.kpad, nlanes)
            cp.cuda.Device().synchronize()
            got.append([b.get() for b in _state(plan)])
            dp = sum(c for (mod, _k), c in n.items() if mod == "gemv_dp")
            if on:
                ran += dp
            else:
                assert dp == 0, name
        for i, (a, b) in enumerate(zip(*got)):
            np.testing.assert_array_equal(b, a, err_msg=f"{name}: buffer {i}")
    assert ran > 0, "no plan ran gemv_dp"


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("depth, lanes, asyn", [(8, 1, 0), (16, 8, 0), (16, 4, 1)])
def test_rounds_keep_the_bits(depth, lanes, asyn, graphs, monkeypatch):
    """Logits and final states of a prefill, decode steps, verify rounds (2-8 lanes) and commits, switch off against
    on (GEMV_DP_LANES 8: the verify rounds too)."""
    from q27py.gpu import constants as C
    from q27py.gpu.runtime import Runtime
    from tests.gpu.plan_rounds import heads27b, rounds

    monkeypatch.setattr(C, "GEMV_DP_DEPTH", depth)
    monkeypatch.setattr(C, "GEMV_DP_LANES", lanes)
    monkeypatch.setattr(C, "GEMV_DP_ASYNC", asyn)
    ids = list(range(3, 40))
    res = []
    for on in (0, 1):
        monkeypatch.setattr(C, "GEMV_DP4A", on)
        m = heads27b(graphs, hidden=None, seed=13, intermediate=17408)
        res.append(rounds(m, ids))
        st = m.new_state()
        m.forward(st, [1, 2, 3], logits_rows="last")
        with Runtime.get().count_launches() as n:
            m.forward(st, [4])
        dp = sum(c for (mod, _k), c in n.items() if mod == "gemv_dp")
        assert (dp > 0) == bool(on), f"gemv_dp launches in a decode step: {dp}"
    for i, (a, b) in enumerate(zip(*res)):
        np.testing.assert_array_equal(b, a, err_msg=f"output {i}")

