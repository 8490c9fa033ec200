"""CPU check of the fused GDN decode kernel's partition (cuda/gdn_decode.cu), no GPU needed.

Two float32 numpy transliterations run on the same inputs: the kernel chain (gdn_conv's
per-(lane, slot) blocks with block_sum, gdn_conv_commit, gdn_step's warp per column,
gated_rmsnorm's block per (lane, head)) and the fused kernel (its grid of (column block, value
head) blocks, its warps' item loops, its flat dynamic shared memory through the kernel's own
offsets, its tickets with blocks run in shuffled orders). Both use the same scalar primitives
(float32 adds and multiplies, the xor butterfly, a deterministic stand-in for fmaf / expf), so
equality checks what the fused kernel could get wrong on its own: which channels, heads and
columns each block reads and writes, the shared-memory layout, the regrouped reductions (the
chain's extra warps hold +0), the record writers and the window slide's ordering. The real
kernel's bits against the real chain are tests/gpu/test_gdn_fused.py (on the device).
"""

from __future__ import annotations

import numpy as np
import pytest

from q27py.gpu import constants as C
from q27py.gpu import kernels as K

F = np.float32
LANE = np.arange(32)
NC = C.GDN_FD_COLS


def warp_sum(v):
    """__shfl_xor_sync butterfly over the last axis (32 lanes): every lane ends with the same sum."""
    v = np.asarray(v, F)
    for o in (16, 8, 4, 2, 1):
        v = (v + v[..., LANE ^ o]).astype(F)
    return v


def block_sum(vals):
    """common.cuh block_sum for a block of len(vals) threads (a multiple of 32)."""
    nw = vals.shape[-1] // 32
    part = warp_sum(np.asarray(vals, F).reshape(nw, 32))[:, 0]
    t = np.zeros(32, F)
    t[:nw] = part
    return warp_sum(t)[0]


def fma(a, b, c):  # deterministic stand-in for fmaf (both transliterations share it)
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(F)


def sigmoid(x):
    x = np.asarray(x, F)
    return (F(1) / (F(1) + np.exp(-x).astype(F))).astype(F)


def softplus(x):
    x = np.asarray(x, F)
    return np.where(x > F(20), x, np.log1p(np.exp(x).astype(F)).astype(F)).astype(F)


def conv_silu(raw, window, convw, kw, t, ch):
    """gdn_conv's taps for lane t at channels ch (an array), then SiLU."""
    acc = np.zeros(np.shape(ch), F)
    for j in range(kw):
        idx = t + j
        xv = window[idx, ch] if idx < kw - 1 else raw[idx - (kw - 1), ch]
        acc = (acc + (convw[ch, j] * xv).astype(F)).astype(F)
    return (acc * sigmoid(acc)).astype(F)


def slide(window, raw, kw, n, ch):
    """gdn_conv_commit for channels ch: read every kept value first, then write."""
    keep = [window[n + i, ch] if n + i < kw - 1 else raw[n + i - (kw - 1), ch] for i in range(kw - 1)]
    for i in range(kw - 1):
        window[i, ch] = keep[i]


def recurrence(s, q, k, v, g, beta):
    """gdn_body for a stack of columns: s [cols, 32, KPL], q / k [32, KPL], v [cols] -> o [cols]."""
    decay = np.exp(F(g)).astype(F)
    pk = np.zeros(s.shape[:2], F)
    for i in range(s.shape[2]):
        s[:, :, i] = (s[:, :, i] * decay).astype(F)
        pk = fma(s[:, :, i], k[None, :, i], pk)
    pred = warp_sum(pk)[:, 0]
    u = (F(beta) * (v - pred).astype(F)).astype(F)
    pq = np.zeros(s.shape[:2], F)
    for i in range(s.shape[2]):
        s[:, :, i] = fma(k[None, :, i], u[:, None], s[:, :, i])
        pq = fma(s[:, :, i], q[None, :, i], pq)
    return warp_sum(pq)[:, 0]


def lane_slices(row, kpl, dk):
    """A dk-row as the warp holds it: lane l, slot i -> element l*KPL + i (0 past dk)."""
    kk = LANE[:, None] * kpl + np.arange(kpl)[None, :]
    return np.where(kk < dk, row[np.minimum(kk, dk - 1)], F(0)).astype(F), kk < dk


# ---------------------------------------------------------------- the chain
def chain(d, h, hv, dk, dv, kw, T, commit):
    c = 2 * h * dk + hv * dv
    raw, window, state = d["raw"], d["window"].copy(), d["state"].copy()
    kpl = {1: 1, 2: 2, 3: 4, 4: 4}[-(-dk // 32)]
    qkvn, gb = np.full((T, c), np.nan, F), np.full((T, 2 * hv), np.nan, F)
    nthr = -(-max(dk, dv) // 32) * 32
    cc = np.arange(nthr)
    q_scale = F(dk) ** F(-0.5)
    for t in range(T):  # gdn_conv
        for slot in range(2 * h + hv):
            is_qk = slot < 2 * h
            dd = dk if is_qk else dv
            ch = slot * dk + cc if is_qk else 2 * h * dk + (slot - 2 * h) * dv + cc
            valid = cc < dd
            y = np.zeros(nthr, F)
            y[valid] = conv_silu(raw, d["window"], d["convw"], kw, t, ch[valid])
            if is_qk:
                ss = block_sum((y * y).astype(F))
                y = (y / np.sqrt(F(ss + F(1e-6)))).astype(F)
                if slot < h:
                    y = (y * q_scale).astype(F)
            qkvn[t, ch[valid]] = y[valid]
            if not is_qk:
                hh = slot - 2 * h
                bb, a = d["ab"][t, hh], d["ab"][t, hv + hh]
                gb[t, hh] = F(d["neg_a"][hh] * softplus(F(a + d["dt"][hh])))
                gb[t, hv + hh] = sigmoid(bb)
    if commit:
        slide(window, raw, kw, T, np.arange(c))
    o = np.full((T, hv * dv), np.nan, F)
    for hh in range(hv):  # gdn_step: one warp per column, all of a head's columns stacked
        kh = hh // (hv // h)
        s = np.stack([lane_slices(state[hh, j], kpl, dk)[0] for j in range(dv)])
        for t in range(T):
            q, _ = lane_slices(qkvn[t, kh * dk : (kh + 1) * dk], kpl, dk)
            k, _ = lane_slices(qkvn[t, h * dk + kh * dk : h * dk + (kh + 1) * dk], kpl, dk)
            v = qkvn[t, 2 * h * dk + hh * dv : 2 * h * dk + (hh + 1) * dv]
            o[t, hh * dv : (hh + 1) * dv] = recurrence(s, q, k, v, gb[t, hh], gb[t, hv + hh])
        if commit:
            kk = LANE[:, None] * kpl + np.arange(kpl)[None, :]
            for j in range(dv):
                state[hh, j, kk[kk < dk]] = s[j][kk < dk]
    y = np.full((T, hv * dv), np.nan, F)
    nthr = -(-dv // 32) * 32
    for t in range(T):  # gated_rmsnorm
        for hh in range(hv):
            vv = np.zeros(nthr, F)
            vv[:dv] = o[t, hh * dv : (hh + 1) * dv]
            ss = block_sum((vv * vv).astype(F))
            den = np.sqrt(F(F(ss / F(dv)) + F(1e-6))).astype(F)
            zz = raw[t, c + hh * dv : c + (hh + 1) * dv]
            y[t, hh * dv : (hh + 1) * dv] = ((vv[:dv] / den).astype(F) * d["norm_w"]).astype(F) * (
                zz * sigmoid(zz)).astype(F)
    return {"qkvn": qkvn, "gb": gb, "o": o, "y": y.astype(F), "state": state, "window": window}


# ---------------------------------------------------------------- the fused kernel
def fused(d, h, hv, dk, dv, kw, T, commit, warps, order_seed):
    c = 2 * h * dk + hv * dv
    raw, window, state = d["raw"], d["window"].copy(), d["state"].copy()
    kpl = {1: 1, 2: 2, 3: 4, 4: 4}[-(-dk // 32)]
    qkvn, gb = np.full((T, c), np.nan, F), np.full((T, 2 * hv), np.nan, F)
    o, y = np.full((T, hv * dv), np.nan, F), np.full((T, hv * dv), np.nan, F)
    cols = warps * NC
    nb = -(-dv // cols)
    rep, nwk, nwv = hv // h, -(-dk // 32), -(-dv // 32)
    q_scale = F(dk) ** F(-0.5)
    tickets = np.zeros(h + hv, int)
    writes = {"qkvn": np.zeros((T, c), int), "gb": np.zeros((T, 2 * hv), int), "win": np.zeros(c, int),
              "state": np.zeros((hv, dv), int)}
    blocks = [(b, hh) for hh in range(hv) for b in range(nb)]
    np.random.default_rng(order_seed).shuffle(blocks)
    for b, hh in blocks:
        kh = hh // rep
        smem = np.full(K.gdn_fused_shared_floats(T, dk, warps), np.nan, F)
        sqk, sv = 0, T * 2 * dk
        sgb = sv + T * cols
        assert sgb + 2 * T == smem.size
        qk_owner = hh % rep == 0 and b == 0
        # 1. conv + SiLU, one element per thread (the order of elements does not matter)
        e = np.arange(T * 2 * dk)  # element e = t * 2dk + sl * dk + cc (each computed alone: vectorized here)
        t_e, sl_e, cc_e = e // (2 * dk), (e % (2 * dk)) // dk, e % dk
        for t in range(T):
            m = t_e == t
            smem[sqk + e[m]] = conv_silu(raw, window, d["convw"], kw, t, (sl_e[m] * h + kh) * dk + cc_e[m])
        for e in range(T * cols):
            t, jj = divmod(e, cols)
            j = b * cols + jj
            if j < dv:
                ch = 2 * h * dk + hh * dv + j
                yv = conv_silu(raw, window, d["convw"], kw, t, np.array([ch]))[0]
                smem[sv + t * cols + jj] = yv
                qkvn[t, ch] = yv
                writes["qkvn"][t, ch] += 1
        for t in range(T):
            bb, a = d["ab"][t, hh], d["ab"][t, hv + hh]
            gg, beta = F(d["neg_a"][hh] * softplus(F(a + d["dt"][hh]))), sigmoid(bb)
            smem[sgb + 2 * t], smem[sgb + 2 * t + 1] = gg, beta
            if b == 0:
                gb[t, hh], gb[t, hv + hh] = gg, beta
                writes["gb"][t, [hh, hv + hh]] += 1
        # 1b. q/k norm: per-group butterflies, group g's sum kept by lane g, the butterfly over those
        for it in range(T * 2):
            t, sl = it >> 1, it & 1
            row = sqk + t * 2 * dk + sl * dk
            p = np.zeros(32, F)
            for g in range(nwk):
                ccv = g * 32 + LANE
                yv = np.where(ccv < dk, smem[row + np.minimum(ccv, dk - 1)], F(0)).astype(F)
                assert not np.isnan(yv).any()
                p[LANE == g] = warp_sum((yv * yv).astype(F))[g]
            ss = warp_sum(p)[0]
            idx = row + np.arange(dk)
            yv = (smem[idx] / np.sqrt(F(ss + F(1e-6)))).astype(F)
            if sl == 0:
                yv = (yv * q_scale).astype(F)
            smem[idx] = yv
            if qk_owner:
                chs = (sl * h + kh) * dk + np.arange(dk)
                qkvn[t, chs] = yv
                writes["qkvn"][t, chs] += 1
        # 1c. window: own v channels now, the key head's q/k channels by the group's last arrival
        if commit:
            for jj in range(cols):
                j = b * cols + jj
                if j < dv:
                    ch = 2 * h * dk + hh * dv + j
                    slide(window, raw, kw, T, np.array([ch]))
                    writes["win"][ch] += 1
            tickets[kh] += 1
            if rep * nb <= 1 or tickets[kh] == rep * nb:
                tickets[kh] = 0
                chs = np.concatenate([kh * dk + np.arange(dk), (h + kh) * dk + np.arange(dk)])
                slide(window, raw, kw, T, chs)
                writes["win"][chs] += 1
        # 2. recurrence, NC columns per warp
        for w in range(warps):
            jw = b * cols + w * NC
            if jw >= dv:
                continue
            s = np.stack([lane_slices(state[hh, jw + cc], kpl, dk)[0] for cc in range(NC)])
            ok = lane_slices(state[hh, jw], kpl, dk)[1]
            for t in range(T):
                row = smem[sqk + t * 2 * dk : sqk + (t + 1) * 2 * dk]
                q = np.where(ok, row[np.minimum(LANE[:, None] * kpl + np.arange(kpl), dk - 1)], F(0)).astype(F)
                k = np.where(ok, row[dk + np.minimum(LANE[:, None] * kpl + np.arange(kpl), dk - 1)], F(0)).astype(F)
                v = smem[sv + t * cols + w * NC : sv + t * cols + w * NC + NC]
                g, beta = smem[sgb + 2 * t], smem[sgb + 2 * t + 1]
                assert not np.isnan(q).any() and not np.isnan(v).any() and not np.isnan([g, beta]).any()
                o[t, hh * dv + jw : hh * dv + jw + NC] = recurrence(s, q, k, v, g, beta)
            if commit:
                kk = LANE[:, None] * kpl + np.arange(kpl)[None, :]
                for cc in range(NC):
                    state[hh, jw + cc, kk[kk < dk]] = s[cc][kk < dk]
                    writes["state"][hh, jw + cc] += 1
        # 3. the head's norm by its last block
        if nb > 1:
            tickets[h + hh] += 1
            if tickets[h + hh] < nb:
                continue
            tickets[h + hh] = 0
        for t in range(T):
            p = np.zeros(32, F)
            for g in range(nwv):
                j = g * 32 + LANE
                vv = np.where(j < dv, o[t, hh * dv + np.minimum(j, dv - 1)], F(0)).astype(F)
                assert not np.isnan(vv).any(), "norm before every column of the head is in"
                p[LANE == g] = warp_sum((vv * vv).astype(F))[g]
            ss = warp_sum(p)[0]
            den = np.sqrt(F(F(ss / F(dv)) + F(1e-6))).astype(F)
            vv = o[t, hh * dv : (hh + 1) * dv]
            zz = raw[t, c + hh * dv : c + (hh + 1) * dv]
            y[t, hh * dv : (hh + 1) * dv] = ((vv / den).astype(F) * d["norm_w"]).astype(F) * (zz * sigmoid(zz)).astype(F)
    assert not tickets.any()
    assert (writes["qkvn"] == 1).all() and (writes["gb"] == 1).all(), "each record written exactly once"
    if commit:
        assert (writes["win"] == 1).all() and (writes["state"] == 1).all()
    return {"qkvn": qkvn, "gb": gb, "o": o, "y": y, "state": state, "window": window}


def make_inputs(rng, T, h, hv, dk, dv, kw):
    c = 2 * h * dk + hv * dv
    return {"raw": rng.standard_normal((T, c + hv * dv)).astype(F), "window": rng.standard_normal((kw - 1, c)).astype(F),
            "convw": (rng.standard_normal((c, kw)) * 0.5).astype(F), "ab": rng.standard_normal((T, 2 * hv)).astype(F),
            "neg_a": (-np.exp(rng.standard_normal(hv) * 0.5)).astype(F), "dt": rng.standard_normal(hv).astype(F),
            "state": (rng.standard_normal((hv, dv, dk)) * 0.3).astype(F),
            "norm_w": (1 + 0.1 * rng.standard_normal(dv)).astype(F)}


# (h, hv, dk, dv, kw, lanes, warps): the tiny models' heads; ragged dk / dv (partial warps, a last
# block with idle warps, more blocks per head than warps); one key head shared by three value heads
CASES = [(2, 6, 64, 64, 4, 3, 8), (2, 6, 64, 64, 4, 1, 1), (2, 4, 40, 24, 4, 5, 2), (1, 3, 98, 36, 3, 2, 4),
         (4, 8, 16, 8, 4, 16, 8), (2, 2, 32, 72, 2, 4, 32)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("commit", [False, True])
def test_fused_partition_equals_chain(case, commit):
    h, hv, dk, dv, kw, T, warps = case
    assert K.gdn_fused_supported(h, hv, dk, dv, kw, T, warps)
    d = make_inputs(np.random.default_rng(sum(case)), T, h, hv, dk, dv, kw)
    want = chain(d, h, hv, dk, dv, kw, T, commit)
    for seed in (0, 1):  # blocks in two shuffled orders: the tickets make the result order-free
        got = fused(d, h, hv, dk, dv, kw, T, commit, warps, seed)
        for name, arr in want.items():
            np.testing.assert_array_equal(got[name], arr, err_msg=name)
    if not commit:
        np.testing.assert_array_equal(got["window"], d["window"])


def test_block_sum_regrouping_is_exact():
    """The fused kernel sums a dk-channel head in ceil(dk/32) warp partials where gdn_conv's block
    had max(dk, dv)/32 warps, the extra ones holding +0: the same bits for every dk."""
    rng = np.random.default_rng(5)
    for dk in (16, 40, 64, 98, 128):
        for nthr in {(-(-dk // 32)) * 32, 128, 256, 1024}:
            if nthr < dk:
                continue
            y = np.zeros(nthr, F)
            y[:dk] = rng.standard_normal(dk).astype(F) * F(10) ** rng.integers(-3, 3)
            sq = (y * y).astype(F)
            nwk = -(-dk // 32)
            parts = warp_sum(np.pad(sq[:dk], (0, nwk * 32 - dk)).reshape(nwk, 32))[:, 0]
            t = np.zeros(32, F)
            t[:nwk] = parts
            assert warp_sum(t)[0] == block_sum(sq)


def test_supported_shapes_and_shared_memory():
    assert K.gdn_fused_supported(16, 48, 128, 128, 4, 16)  # the 27B at every verify width
    assert K.gdn_fused_supported(16, 48, 128, 128, 4, 16, warps=C.GDN_FD_MAX_WARPS)
    assert not K.gdn_fused_supported(16, 48, 128, 130, 4, 1)  # dv % GDN_FD_COLS
    assert not K.gdn_fused_supported(16, 48, 160, 128, 4, 1)  # dk > 128
    assert not K.gdn_fused_supported(16, 48, 128, 128, 10, 1)  # window > 8 rows
    assert not K.gdn_fused_supported(16, 48, 128, 128, 4, 1, warps=C.GDN_FD_MAX_WARPS + 1)
    assert not K.gdn_fused_supported(16, 48, 128, 128, 4, 64)  # a prefill chunk's lanes exceed 48 KB
    # q/k rows 16-byte aligned for the kernel's float4 reads (dk % 4 == 0), v after them
    assert K.gdn_fused_shared_floats(16, 128, 8) == 16 * (256 + 32 + 2)


def test_switch_comes_from_the_config(monkeypatch):
    from q27py.config import Q27Config, apply_env

    assert Q27Config().engine.gdn_fused is False  # until the device run has measured it
    assert apply_env(Q27Config(), {"Q27_GDN_FUSED": "1"}).engine.gdn_fused is True
    assert apply_env(Q27Config(), {"Q27_GDN_FUSED": "0"}).engine.gdn_fused is False
    with pytest.raises(ValueError, match="0 or 1"):
        apply_env(Q27Config(), {"Q27_GDN_FUSED": "yes"})
    old = K._GDN_FUSED
    try:
        K._GDN_FUSED = None
        monkeypatch.setenv("Q27_GDN_FUSED", "1")
        assert K.gdn_fused_default() is True  # what FastModel(gdn_fused=None) takes
    finally:
        K._GDN_FUSED = old
