"""cuda/gdn.cu's column layout, emulated in float32 on the CPU: LPC real lanes per value column, real
lane g holding the virtual lanes g + LPC m, the butterfly's upper offsets as an add tree in registers.
The claim the kernel's comment makes (and the device tests and gates check on the GPU): for every LPC
this is the same arithmetic, bit for bit, as the original one-warp-per-column kernel -- virtual lane l
holding k indices l * KPL + i, a KPL-long fmaf chain, a 32-wide xor butterfly (offsets 16 .. 1).
fmaf is emulated (the float64 product of two float32 values is exact; the sum is rounded to float64,
then to float32); both forms use the same emulation, so only the order of operations can separate them."""

from __future__ import annotations

import numpy as np
import pytest

from q27py.gpu import constants as C

f32 = np.float32


def fmaf(a, b, c):
    return f32(np.float64(a) * np.float64(b) + np.float64(c))


def warp_butterfly(v):
    """__shfl_xor_sync butterfly over 32 lane values: lane l adds lane l ^ o, o = 16, 8, 4, 2, 1."""
    v = list(v)
    for o in (16, 8, 4, 2, 1):
        v = [f32(v[l] + v[l ^ o]) for l in range(32)]
    assert all(x == v[0] or (np.isnan(x) and np.isnan(v[0])) for x in v)
    return v[0]


def column_original(s, k, q, v, decay, beta, kpl):
    """One column's token step as the one-warp-per-column kernel did it (s: 32 x kpl virtual-lane state)."""
    s = s.copy()
    pk = np.zeros(32, f32)
    for l in range(32):
        for i in range(kpl):
            s[l, i] = f32(s[l, i] * decay)
            pk[l] = fmaf(s[l, i], k[l, i], pk[l])
    u = f32(beta * f32(v - warp_butterfly(pk)))
    pq = np.zeros(32, f32)
    for l in range(32):
        for i in range(kpl):
            s[l, i] = fmaf(k[l, i], u, s[l, i])
            pq[l] = fmaf(s[l, i], q[l, i], pq[l])
    return s, warp_butterfly(pq)


def tree_then_shuffles(p, lpc):
    """gdn_butterfly: p[g][m] = virtual lane g + lpc m's partial, for the lpc real lanes g."""
    vpl = 32 // lpc
    c = []
    for g in range(lpc):
        x = list(p[g])
        half = vpl // 2
        while half >= 1:
            for m in range(half):
                x[m] = f32(x[m] + x[m + half])
            half //= 2
        c.append(x[0])
    o = lpc // 2
    while o >= 1:
        c = [f32(c[g] + c[g ^ o]) for g in range(lpc)]
        o //= 2
    assert len(set(float(x) for x in c)) == 1  # every real lane of the column holds the same sum
    return c[0]


def column_layout(s, k, q, v, decay, beta, kpl, lpc):
    """The same step in the LPC layout (s indexed by virtual lane, as the kernel's s[m][i] of lane g)."""
    vpl = 32 // lpc
    s = s.copy()
    p = [[f32(0)] * vpl for _ in range(lpc)]
    for g in range(lpc):
        for m in range(vpl):
            l = g + lpc * m
            for i in range(kpl):
                s[l, i] = f32(s[l, i] * decay)
                p[g][m] = fmaf(s[l, i], k[l, i], p[g][m])
    u = f32(beta * f32(v - tree_then_shuffles(p, lpc)))
    p = [[f32(0)] * vpl for _ in range(lpc)]
    for g in range(lpc):
        for m in range(vpl):
            l = g + lpc * m
            for i in range(kpl):
                s[l, i] = fmaf(k[l, i], u, s[l, i])
                p[g][m] = fmaf(s[l, i], q[l, i], p[g][m])
    return s, tree_then_shuffles(p, lpc)


@pytest.mark.parametrize("lpc", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("dk", [16, 96, 128])
def test_layout_matches_one_warp_per_column_bitwise(lpc, dk):
    kpl = 4 if dk > 64 else -(-dk // 32)
    rng = np.random.default_rng(lpc * 1000 + dk)
    valid = (np.arange(32)[:, None] * kpl + np.arange(kpl)[None, :]) < dk  # the kernels' zero padding past dk
    s = np.where(valid, rng.standard_normal((32, kpl)) * 0.3, 0).astype(f32)
    s_ref, s_lay = s.copy(), s.copy()
    for t in range(3):  # a few tokens: the state carries the bits forward
        k = np.where(valid, rng.standard_normal((32, kpl)) / np.sqrt(dk), 0).astype(f32)
        q = np.where(valid, rng.standard_normal((32, kpl)) / np.sqrt(dk), 0).astype(f32)
        v, decay, beta = f32(rng.standard_normal()), f32(np.exp(-0.3 * rng.random())), f32(rng.random())
        s_ref, o_ref = column_original(s_ref, k, q, v, decay, beta, kpl)
        s_lay, o_lay = column_layout(s_lay, k, q, v, decay, beta, kpl, lpc)
        assert o_ref.tobytes() == o_lay.tobytes(), (t, o_ref, o_lay)
        assert s_ref.tobytes() == s_lay.tobytes()


def test_sequential_sum_order_would_differ():
    """The test can fail: summing the same partials in lane order (not the butterfly's pairs) changes
    the bits for some inputs, so a layout that reordered the reduction would be caught."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        p = (rng.standard_normal(32) * 10.0 ** rng.integers(-3, 4, 32)).astype(f32)
        seq = f32(0)
        for x in p:
            seq = f32(seq + x)
        if seq.tobytes() != warp_butterfly(p).tobytes():
            return
    pytest.fail("no input separated the two summation orders")


def test_table_lpc_divides_the_warp():
    assert 32 % C.GDN_ST_LPC == 0 and C.GDN_ST_LPC & (C.GDN_ST_LPC - 1) == 0
    assert C.GDN_ST_TILE >= 16  # >= the verify span: one staging burst per verify round
