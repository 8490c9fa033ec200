"""constants CONV_COMMIT_FOLD (cuda/conv.cu gdn_conv_body win_commit): a decode step's conv slides the GDN conv window
itself, so the step has no gdn_conv_commit launch. Bitwise: the conv's outputs and the window afterwards are those of
gdn_conv followed by gdn_conv_commit(n=1), at the kernel and through the model's decode steps (eager and graphs). The
decode_batch entry (gdn_conv_lanes, each lane its own state's window) is checked by running
tests/gpu/test_decode_batch.py with the switch on (tools/device_wave.sh s13)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def test_conv_slides_the_window_as_the_commit_does():
    import cupy as cp

    from q27py.gpu import kernels as K

    rng = np.random.default_rng(5)
    hk, hv, dk, dv, kw = 16, 48, 128, 128, 4
    c = 2 * hk * dk + hv * dv
    raw = cp.asarray(rng.standard_normal((1, c)).astype(np.float32))
    win0 = rng.standard_normal((kw - 1, c)).astype(np.float32)
    convw = cp.asarray(rng.standard_normal((c, kw)).astype(np.float32) * 0.3)
    ab = cp.asarray(rng.standard_normal((1, 2 * hv)).astype(np.float32))
    neg_a = cp.asarray(-np.exp(rng.standard_normal(hv)).astype(np.float32))
    dt = cp.asarray(rng.standard_normal(hv).astype(np.float32))
    outs = []
    for fold in (False, True):
        win = cp.asarray(win0)
        qkvn, gb = cp.full((1, c), np.nan, cp.float32), cp.full((1, 2 * hv), np.nan, cp.float32)
        K.gdn_conv(raw, c, win, convw, ab, 2 * hv, neg_a, dt, hk, hv, dk, dv, kw, qkvn, gb, 1, commit=fold)
        if not fold:
            K.gdn_conv_commit(win, 0, raw, c, 0, c, kw, 1, n=1)
        outs.append((qkvn.get(), gb.get(), win.get()))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(outs[1][2], np.concatenate([win0[1:], raw.get()]))  # slid by the raw row
    with pytest.raises(AssertionError):
        K.gdn_conv(raw, c, cp.asarray(win0), convw, ab, 2 * hv, neg_a, dt, hk, hv, dk, dv, kw, qkvn, gb, 2, commit=True)


@pytest.mark.parametrize("graphs", [False, True])
def test_decode_steps_keep_their_bits(graphs, monkeypatch):
    """The 27B's heads: a prefill, then decode steps (the fold's path) and a verify round with its commit (the
    commit's own path), switch off against on: every logit row and the final GDN state and window bitwise."""
    from q27py.gpu import constants as C
    from tests.gpu.plan_rounds import heads27b, rounds

    ids = [int(v) for v in np.random.default_rng(6).integers(0, 4096, 30)]
    got = {}
    for fold in (0, 1):
        monkeypatch.setattr(C, "CONV_COMMIT_FOLD", fold)
        m = heads27b(graphs, hidden=None, seed=13)
        got[fold] = rounds(m, ids, widths=(1, 3, 6))
    for a, b in zip(got[0], got[1]):
        np.testing.assert_array_equal(a, b)
