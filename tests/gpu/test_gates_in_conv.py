"""constants GDN_GATES_IN_CONV (cuda/conv.cu gates_dot2, kernels.GatesInConv, GemvPlan.run skip_bf16): gdn_conv's
v-head blocks compute a GDN layer's decay / beta gates b, a from the normed rows instead of the in plan's bf16 GEMV.

CPU: the kernel's index math into the packed bf16 layout (mirrored here word for word) reads exactly rows h and
HV + h of the matrix, every k pair once. GPU: the conv's b / a against float64 on the same bf16 weights, the switch's
model against the GEMV's (its own bits: fp32 sums of exact products, within 1e-5 relative of them on b / a, the same
greedy ids on the 27B's heads), its bits width-invariant (a verify lane = a decode step) and the bf16 launch gone.
"""

from __future__ import annotations

import numpy as np
import pytest

from q27py.gpu import layout as L


def gates_words(words: np.ndarray, kch: int, row: int) -> np.ndarray:
    """conv.cu gates_dot2's loads for one row, in k-pair order q = 0 .. kch * 32 - 1: the u32 words (bf16 lo = k 2q,
    hi = k 2q + 1)."""
    tile = words[(row >> 4) * kch * 512:]
    o = (row & 7) * 16 + ((row & 15) >> 3)
    out = np.empty(kch * 32, np.uint32)
    for q in range(kch * 32):
        c, p = q >> 5, q & 31
        w = c * 512 + (p >> 3) * 128 + (p & 3) * 4 + 2 * ((p & 7) >> 2)
        out[q] = tile[w + o]
    return out


@pytest.mark.parametrize("hv,k", [(48, 5120), (8, 256), (5, 192)])
def test_index_math_reads_the_rows_b_and_a(hv, k):
    rng = np.random.default_rng(hv)
    w = rng.standard_normal((2 * hv, k)).astype(np.float32)
    pm = L.pack_matrix(w, L.FMT_BF16)
    words = pm.codes.view(np.uint32)
    want = L.bf16_to_f32(L.bf16_bits(w))
    for h in {0, 1, hv // 2, hv - 1}:
        for row in (h, hv + h):
            got = gates_words(words, pm.shape.kchunks, row)
            lo = L.bf16_to_f32((got & 0xFFFF).astype(np.uint16))
            hi = L.bf16_to_f32((got >> 16).astype(np.uint16))
            pairs = np.stack([lo, hi], axis=1).reshape(-1)
            np.testing.assert_array_equal(pairs[:k], want[row])
            assert not pairs[k:].any()  # the pad past K reads as zero


@pytest.mark.gpu
def test_conv_gates_match_float64_and_the_gemv():
    """gdn_conv with GatesInConv writes gb from its own b / a: against float64 on the bf16 weights (fp32 sums of
    exact products, ~1e-6 relative) and against gdn_conv fed by the in plan's GEMV (its hi + lo bf16 x: a few 1e-6)."""
    import cupy as cp

    from q27py.gpu import kernels as K

    rng = np.random.default_rng(7)
    hk, hv, dk, dv, kw, hidden, n = 16, 48, 128, 128, 4, 5120, 9
    c = 2 * hk * dk + hv * dv
    wab = rng.standard_normal((2 * hv, hidden)).astype(np.float32) * 0.02
    mab = K.upload_packed(L.pack_matrix(wab, L.FMT_BF16))
    x = rng.standard_normal((n, hidden)).astype(np.float32)
    raw = cp.asarray(rng.standard_normal((n, c)).astype(np.float32))
    window = cp.asarray(rng.standard_normal((kw - 1, c)).astype(np.float32))
    convw = cp.asarray(rng.standard_normal((c, kw)).astype(np.float32) * 0.3)
    neg_a = cp.asarray(-np.exp(rng.standard_normal(hv)).astype(np.float32))
    dt = cp.asarray(rng.standard_normal(hv).astype(np.float32))
    xd = cp.asarray(x)
    ab = cp.full((n, 2 * hv), np.nan, cp.float32)
    K.GemvPlan([mab], [(ab, 2 * hv)], K.Workspace()).run(xd, hidden, n, allow_gemm=False)
    outs = {}
    for name, gates in (("gemv", None), ("conv", K.GatesInConv(mab, xd, hidden))):
        qkvn, gb = cp.full((n, c), np.nan, cp.float32), cp.full((n, 2 * hv), np.nan, cp.float32)
        K.gdn_conv(raw, c, window, convw, ab if gates is None else cp.full_like(ab, np.nan), 2 * hv, neg_a, dt, hk, hv,
                   dk, dv, kw, qkvn, gb, n, gates=gates)
        outs[name] = (qkvn.get(), gb.get())
    np.testing.assert_array_equal(outs["conv"][0], outs["gemv"][0])  # the conv itself untouched
    wb = L.bf16_to_f32(L.bf16_bits(wab)).astype(np.float64)
    ref = x.astype(np.float64) @ wb.T  # [n, 2 hv]: b then a
    b, a = ref[:, :hv], ref[:, hv:]
    na, dtb = neg_a.get().astype(np.float64), dt.get().astype(np.float64)
    g_ref = na * np.log1p(np.exp(a + dtb))
    beta_ref = 1 / (1 + np.exp(-b))
    got = outs["conv"][1]
    assert np.abs(got[:, :hv] - g_ref).max() <= 1e-5 * (1 + np.abs(g_ref).max())
    assert np.abs(got[:, hv:] - beta_ref).max() <= 4e-6
    gem = outs["gemv"][1]
    assert (np.abs(got - gem) <= 2e-4 * (1 + np.abs(gem))).all()


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_model_with_gates_in_conv(graphs, monkeypatch):
    """The 27B's heads (3 GDN layers, q4s, the gates bf16): rounds with the switch on against off -- close (its own
    sums), the same greedy picks -- and on, a verify round's lanes equal to decode steps bitwise (the conv's gates are
    per lane), the in plan's bf16 launch gone from a decode step."""
    from q27py.gpu import constants as C
    from q27py.gpu.runtime import Runtime
    from tests.gpu.plan_rounds import heads27b, rounds

    ids = [int(v) for v in np.random.default_rng(4).integers(0, 4096, 40)]
    got, counts = {}, {}
    for on in (0, 1):
        monkeypatch.setattr(C, "GDN_GATES_IN_CONV", on)
        m = heads27b(graphs, hidden=None, seed=11)
        assert m.gates_in_conv == bool(on)
        got[on] = rounds(m, ids, widths=(2, 5, 9))
        st = m.new_state()
        m.forward(st, [1, 2, 3], logits_rows="last")
        with Runtime.get().count_launches() as dec:
            m.forward(st, [4])
        counts[on] = dec
    for a, b in zip(got[0][:-2], got[1][:-2]):  # logits: close, the same argmax wherever the top two are apart
        a, b = (np.asarray(v, np.float64).reshape(-1, np.shape(v)[-1]) for v in (a, b))
        assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(a)
        top = np.sort(a, axis=1)
        clear = top[:, -1] - top[:, -2] > 1e-3 * np.abs(a).max()
        np.testing.assert_array_equal(np.argmax(a, 1)[clear], np.argmax(b, 1)[clear])
    assert counts[0][("gemv", "gemv_bf16_nt1")] - counts[1].get(("gemv", "gemv_bf16_nt1"), 0) == 3
    # width invariance with the switch on: 3 decode steps == a verify of the same 3 tokens, lane by lane
    monkeypatch.setattr(C, "GDN_GATES_IN_CONV", 1)
    m = heads27b(False, hidden=None, seed=11)
    a, b = m.new_state(), m.new_state()
    m.forward(a, ids[:20], logits_rows="last")
    m.forward(b, ids[:20], logits_rows="last")
    steps = [m.forward(a, [t]).logits for t in (7, 8, 9)]
    v = m.forward(b, [7, 8, 9], verify=True).logits
    for i, s in enumerate(steps):
        np.testing.assert_array_equal(np.asarray(s).reshape(-1), np.asarray(v)[i].reshape(-1))
