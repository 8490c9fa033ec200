"""gate_up's epilogue hands down its a8 activations (kernels.GemvPlan quant_into, cuda/gemv_common.cuh
swiglu_act8): the second of each 64-k chunk's two row groups to finish quantizes the chunk, so the down
projection runs prequantized, one quant_act8 launch fewer per MLP of a decode / verify step. Held bitwise
against the unfused pair (gate_up, then down quantizing its own input) on both GEMV kernels (q4: gemv_wg where
the card has it, q8: gemv.cu), under forced K splits (the split-K ticket and cluster paths), an odd row-group
count (a last chunk of one row group) and a padded last chunk; wider launches (17-32 lanes) leave the fold out
and down quantizes for itself.
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


@pytest.mark.parametrize("fmt", [L.FMT_Q4, L.FMT_Q8])
@pytest.mark.parametrize("inter", [200, 1024])
@pytest.mark.parametrize("splits", [None, 2, 3, 5])
def test_gate_up_writes_downs_a8_activations_bitwise(K, fmt, inter, splits):
    import cupy as cp

    rng = np.random.default_rng(inter + (splits or 0))
    cols, rows = 256, 96
    kpad = L.round_up(inter, L.CHUNK_K)
    gate = rng.standard_normal((inter, cols)).astype(np.float32) * 0.1
    up = rng.standard_normal((inter, cols)).astype(np.float32) * 0.1
    mu = K.upload_packed(L.pack_matrix(L.interleave_gate_up(gate, up), fmt), mode=K.MODE_SWIGLU, out_rows=inter)
    md = K.upload_packed(L.pack_matrix(rng.standard_normal((rows, inter)).astype(np.float32) * 0.05, fmt))
    part = None if splits is None else (1, splits)
    for n in (1, 5, 8, 16, 17, 32):
        x = cp.asarray(np.pad(rng.standard_normal((n, cols)).astype(np.float32), ((0, 0), (0, 0))))
        outs = []
        for fold in (False, True):
            ws = K.Workspace()
            act = cp.zeros((n, kpad), cp.float32)  # the padding columns are read as quant_act8 reads them
            y = cp.full((n, rows), np.nan, cp.float32)
            down = K.GemvPlan([md], [(y, rows)], ws, impl="a8", act8_slot=1 if fold else 0)
            upp = K.GemvPlan([mu], [(act, kpad)], ws, impl="a8", partition=part, quant_into=down if fold else None)
            if fold:
                down.xq.fill(0xAB)
                down.xs.fill(np.nan)
            pre = upp.quantizes_for(down, n)
            assert pre == (fold and n <= 16)
            upp.run(x, cols, n)
            down.run(act, kpad, n, prequantized=pre)
            outs.append((act.get(), down.xq.get()[:n, :kpad].copy(), down.xs.get().reshape(-1, kpad // 64, 16), y.get()))
            assert not ws.cnt.get().any(), "arrival counters and tickets are left zero for the next launch"
        (a0, q0, s0, y0), (a1, q1, s1, y1) = outs
        np.testing.assert_array_equal(a1, a0, err_msg=f"act n={n}")
        if n <= 16:  # the handed-over bytes (wider rounds quantize in blocks of their own layout: only y counts)
            np.testing.assert_array_equal(q1, q0, err_msg=f"codes n={n}")
            np.testing.assert_array_equal(s1[0, :, :n], s0[0, :, :n], err_msg=f"scales n={n}")
        np.testing.assert_array_equal(y1, y0, err_msg=f"down n={n}")
        assert not np.isnan(y1).any()


def test_graph_replays_reset_the_arrival_counters(K):
    """The fold's counters return to zero after every launch, so replaying the same two launches keeps the bits."""
    import cupy as cp

    rng = np.random.default_rng(3)
    cols, inter, rows, n = 256, 320, 64, 3
    mu = K.upload_packed(L.pack_matrix(L.interleave_gate_up(rng.standard_normal((inter, cols)).astype(np.float32) * 0.1,
                                                            rng.standard_normal((inter, cols)).astype(np.float32) * 0.1),
                                       L.FMT_Q4), mode=K.MODE_SWIGLU, out_rows=inter)
    md = K.upload_packed(L.pack_matrix(rng.standard_normal((rows, inter)).astype(np.float32) * 0.05, L.FMT_Q4))
    ws = K.Workspace()
    act, y = cp.zeros((n, inter), cp.float32), cp.zeros((n, rows), cp.float32)
    down = K.GemvPlan([md], [(y, rows)], ws, impl="a8", act8_slot=1)
    upp = K.GemvPlan([mu], [(act, inter)], ws, impl="a8", quant_into=down)
    x = cp.asarray(rng.standard_normal((n, cols)).astype(np.float32))
    got = []
    for _ in range(4):
        upp.run(x, cols, n)
        down.run(act, inter, n, prequantized=True)
        got.append(y.get())
    for g in got[1:]:
        np.testing.assert_array_equal(g, got[0])
    assert not ws.cnt.get().any()
