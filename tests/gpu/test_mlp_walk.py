"""constants MLP_WALK (cuda/gemv_wg.cu's *_walk entries, kernels.GemvPlan.walks_into / run_walk, FastModel._mlp): a
decode / verify MLP of 1-8 lanes runs gate_up and down as one grid. gate_up's epilogue quantizes down's input a chunk
at a time and flags it (gemv_common.cuh swiglu_act8); down's units, claimed after every gate_up unit, wait on their
own chunks' flags instead of on a grid. Held bitwise against the two launches (gate_up, then down quantizing its own
input): the plan pair at several shapes, forced K splits on both sides (the split-K tickets of the two plans share a
grid, so their workspace ranges must not overlap), 1-8 lanes, both entries (1: n8, 2: n8d); replays leave the ticket,
the flags and the counters zero; and the model rounds (decode, verify, commits, eager and graphs) with the walk off
and on, with one launch fewer per layer where it runs.

Device command: python3 -m pytest -q tests/gpu/test_mlp_walk.py
"""

from __future__ import annotations

import numpy as np
import pytest

from q27py.gpu import layout as L

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def K():
    from q27py.gpu import kernels
    from q27py.gpu.runtime import Runtime

    Runtime.get().warm_all()
    return kernels


def _pair(K, rng, cols, inter, rows, up_splits, down_splits, walk):
    import cupy as cp

    gate = rng.standard_normal((inter, cols)).astype(np.float32) * 0.1
    up = rng.standard_normal((inter, cols)).astype(np.float32) * 0.1
    mu = K.upload_packed(L.pack_matrix(L.interleave_gate_up(gate, up), L.FMT_Q4), mode=K.MODE_SWIGLU, out_rows=inter)
    md = K.upload_packed(L.pack_matrix(rng.standard_normal((rows, inter)).astype(np.float32) * 0.05, L.FMT_Q4))
    kpad = L.round_up(inter, L.CHUNK_K)
    ws = K.Workspace()
    act = cp.zeros((16, kpad), cp.float32)
    y = cp.zeros((16, rows), cp.float32)
    down = K.GemvPlan([md], [(y, rows)], ws, impl="a8", act8_slot=1,
                      partition=None if down_splits is None else (1, down_splits))
    upp = K.GemvPlan([mu], [(act, kpad)], ws, impl="a8", walk_into=down if walk else None,
                     partition=None if up_splits is None else (1, up_splits))
    return ws, upp, down, act, y, kpad


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("shape", [(256, 200, 96, None, None), (256, 1024, 192, 2, 3), (1024, 4096, 512, None, 5),
                                   (2048, 6144, 1024, None, None)])
def test_walk_equals_the_two_launches(K, wg, shape, mode, monkeypatch):
    """One grid of both plans' units gives down's outputs (residual add included) bit for bit, with down's own
    a8 buffers filled with junk first (the walk must read what gate_up's epilogue wrote, after its flag)."""
    import cupy as cp

    from q27py.gpu import constants as C

    cols, inter, rows, us, ds = shape
    monkeypatch.setattr(C, "MLP_WALK", mode)
    monkeypatch.setattr(C, "MLP_WALK_LANES", 16)
    rng = np.random.default_rng(inter + rows)
    ws0, up0, down0, act0, y0, kpad = _pair(K, rng, cols, inter, rows, us, ds, walk=False)
    rng = np.random.default_rng(inter + rows)
    ws1, up1, down1, act1, y1, _ = _pair(K, rng, cols, inter, rows, us, ds, walk=True)
    for n in (1, 3, 8, 12, 16):
        x = cp.asarray(rng.standard_normal((n, cols)).astype(np.float32))
        h = rng.standard_normal((n, rows)).astype(np.float32)
        y0[:n], y1[:n] = cp.asarray(h), cp.asarray(h)
        up0.run(x, cols, n)
        down0.run(act0, kpad, n)
        assert up1.walks_into(down1, n) and not up0.walks_into(down0, n)
        down1.xq.fill(0xAB)
        down1.xs.fill(np.nan)
        up1.run_walk(down1, x, cols, n)
        np.testing.assert_array_equal(act1[:n].get(), act0[:n].get(), err_msg=f"SwiGLU rows n={n}")
        np.testing.assert_array_equal(y1[:n].get(), y0[:n].get(), err_msg=f"down n={n}")
        assert not np.isnan(y1[:n].get()).any()
        assert not up1.walk[3].get().any(), "ticket, count, flags and arrival counters left zero"
        assert not ws1.cnt.get().any(), "split-K tickets left zero"


def test_walk_rules(K, wg, monkeypatch):
    """Which blocks walk: off by default and with the switch 0, never past 8 lanes, never for a plan built without
    walk_into or for another next plan."""
    import cupy as cp

    from q27py.gpu import constants as C

    rng = np.random.default_rng(1)
    _ws, upp, down, _act, _y, _kpad = _pair(K, rng, 256, 512, 128, None, None, walk=True)
    _ws2, up2, down2, _a2, _y2, _k2 = _pair(K, rng, 256, 512, 128, None, None, walk=False)
    assert C.MLP_WALK == 0 and not upp.walks_into(down, 1)
    monkeypatch.setattr(C, "MLP_WALK", 1)
    assert [upp.walks_into(down, n) for n in (1, 8, 9, 16)] == [True, True, False, False]
    monkeypatch.setattr(C, "MLP_WALK_LANES", 16)
    assert [upp.walks_into(down, n) for n in (1, 9, 16, 17)] == [True, True, True, False]
    assert not upp.walks_into(down2, 1) and not up2.walks_into(down2, 1)
    with pytest.raises(AssertionError):
        upp.run_walk(down, cp.zeros((17, 256), cp.float32), 256, 17)


def test_replays_keep_the_bits(K, wg, monkeypatch):
    """The same walk launched over and over (as a captured graph replays it) gives the same bits each time: the
    grid's last CTA leaves the ticket and the flags zero for the next launch."""
    import cupy as cp

    from q27py.gpu import constants as C

    monkeypatch.setattr(C, "MLP_WALK", 1)
    rng = np.random.default_rng(5)
    _ws, upp, down, _act, y, kpad = _pair(K, rng, 512, 2048, 256, 2, 3, walk=True)
    x = cp.asarray(rng.standard_normal((2, 512)).astype(np.float32))
    got = []
    for _ in range(6):
        y[:2] = 0
        upp.run_walk(down, x, 512, 2)
        got.append(y[:2].get())
    for g in got[1:]:
        np.testing.assert_array_equal(g, got[0])
    assert not upp.walk[3].get().any()


@pytest.mark.parametrize("mode, lanes", [(1, 8), (2, 8), (1, 16)])
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("inter", [1024, 17408])
def test_model_rounds_keep_the_bits(inter, graphs, mode, lanes, wg, monkeypatch):
    """Model rounds with MLP_WALK off and on (decode, verify widths up to 12 -- past MLP_WALK_LANES the two launches
    run -- and commits), eager and under graphs, at a small MLP and at the 27B's (17,408: gate_up two waves, down 3 K
    splits): the same logits and states. Each of the 4 layers' MLP is one walk launch
    in a decode step and a 2-lane verify: 4 walk launches, 4 launches fewer (gate_up's + down's become one; the
    quant_act8 launch A8_FOLD leaves between them goes too)."""
    from q27py.gpu import constants as C
    from tests.gpu.plan_rounds import decode_counts, heads27b, rounds

    ids = [int(v) for v in np.random.default_rng(11).integers(0, 4096, 41)]
    got, counts = {}, {}
    monkeypatch.setattr(C, "MLP_WALK_LANES", lanes)
    for on in (0, mode):
        monkeypatch.setattr(C, "MLP_WALK", on)
        m = heads27b(graphs, hidden=None, seed=13, intermediate=inter)
        got[on] = rounds(m, ids, widths=(1, 2, 3, 8, 12))
        counts[on] = decode_counts(m)
    for i, (a, b) in enumerate(zip(got[0], got[mode])):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")
    for k in (0, 1):
        off, on = counts[0][k], counts[mode][k]
        walks = sum(v for (mod, name), v in on.items() if mod == "gemv_wg" and name.endswith("_walk"))
        assert walks == 4, on
        quant = off.get(("gemv", "quant_act8"), 0) - on.get(("gemv", "quant_act8"), 0)
        assert sum(off.values()) - sum(on.values()) == 4 + quant
