"""A numpy transliteration of cuda/gdn_chunk2.cu (the three-kernel "chunked2" pipeline), lane by lane
where layout matters.

Every mma goes through the PTX m16n8k8 tf32 fragment map per lane (a0..a3, b0, b1 gathered by the
kernel's own index formulas, 3xTF32 split), the swizzled shared tiles are flat arrays written and
read through sw_row / sw_col, and the scratch is the kernel's flat chunk-padded, fragment-native
layout. So a wrong permuted-k fragment, swizzle, scratch offset or chunk span shows up here on the
CPU as a mismatch against the numpy spec (q27py/model/gdn_chunked.py). Only the PTX fragment layout
is assumed; tests/gpu/test_gdn_chunk.py checks the real kernels.
"""

from __future__ import annotations

import numpy as np

from gdn_chunk_emu import GQ, TQ, split, tf32  # noqa: F401  (same lane map and tf32 rounding)

from q27py.gpu import constants

C = constants.GDN2_C  # the kernels' compile-time chunk and state-pass column tile
BV = constants.GDN2_BV
GATES = constants.GDN2_GATES


def mma3(d, a, b0, b1):
    """d (4, 32) += A B in 3xTF32; a = the four A registers (32 lanes each), b0 / b1 the B registers."""
    af = np.zeros((16, 8), np.float32)
    af[GQ, TQ], af[GQ + 8, TQ], af[GQ, TQ + 4], af[GQ + 8, TQ + 4] = a
    bf = np.zeros((8, 8), np.float32)
    bf[TQ, GQ], bf[TQ + 4, GQ] = b0, b1
    ah, al = split(af)
    bh, bl = split(bf)
    p = al.astype(np.float64) @ bh + ah.astype(np.float64) @ bl + ah.astype(np.float64) @ bh
    for e in range(4):
        d[e] = (d[e] + p[GQ + (e >> 1) * 8, 2 * TQ + (e & 1)]).astype(np.float32)


def ctile_a(c):
    """split_ctile: a C-fragment tile as an A fragment with k permuted."""
    return [c[0], c[2], c[1], c[3]]


def sw_row(row, col):
    return col ^ ((row & 3) << 3)


def sw_col(row, col):
    return col ^ (((row >> 1) & 3) << 3)


def k_pair_at(r0, c, dk):
    """Where the presplit state pass keeps the pair (K[r0][c], K[r0 + 1][c]) (cuda k_pair_at)."""
    q = (c & 7) >> 1
    return (r0 + (q >> 1)) * dk + sw_col(r0, (c & ~7) + 4 * (q & 1)) + 2 * (c & 1)


def k_pairs(sK, DK):
    """The presplit state pass's K split loop, values left whole (the split is elementwise and the same
    split_tf32 at use): each (row pair, column octet) unit's 4 slots rewritten as column pairs."""
    out = np.full_like(sK, np.nan)
    for u in range((C // 2) * (DK // 8)):
        r0, c = 2 * (u // (DK // 8)), 8 * (u % (DK // 8))
        a0, a1 = r0 * DK + sw_col(r0, c), r0 * DK + sw_col(r0, c + 4)
        x0, x1, y0, y1 = (sK[a : a + 4] for a in (a0, a1, a0 + DK, a1 + DK))
        pr = [[x0[0], y0[0], x0[1], y0[1]], [x0[2], y0[2], x0[3], y0[3]], [x1[0], y1[0], x1[1], y1[1]],
              [x1[2], y1[2], x1[3], y1[3]]]
        for q, a in enumerate((a0, a1, a0 + DK, a1 + DK)):
            out[a : a + 4] = pr[q]
    return out


def chunk_span(ci, nlanes, pos0):
    first = C - pos0 % C
    c0 = 0 if ci == 0 else first + (ci - 1) * C
    return c0, min(nlanes, first if ci == 0 else c0 + C) - c0


def nchunks(nlanes, pos0):
    first = C - pos0 % C
    return 1 if nlanes <= first else 1 + -(-(nlanes - first) // C)


def cumsum_scan(x):
    """chunk_cumsum: warp 0's two shfl_up scans in double (IEEE adds in the kernel's order, so the
    same bits), returned as the two floats (hi, lo) the kernel keeps."""
    lane = np.arange(32)
    x0, x1 = x[:32].astype(np.float64), x[32:].astype(np.float64)
    o = 1
    while o < 32:
        y0, y1 = np.roll(x0, o), np.roll(x1, o)
        m = lane >= o
        x0, x1 = np.where(m, x0 + y0, x0), np.where(m, x1 + y1, x1)
        o <<= 1
    g = np.concatenate([x0, x1 + x0[31]])
    hi = g.astype(np.float32)
    return hi, (g - hi).astype(np.float32)


def gdiff(hi, lo, i, m):
    """The kernel's gdiff: (hi_i - hi_m) + (lo_i - lo_m) in float32."""
    return ((hi[i] - hi[m]) + (lo[i] - lo[m])).astype(np.float32)


def prep(qkvn, gb, wsc, usc, gsc, H, HV, DK, DV, nlanes, pos0, nc):
    NW, NT = 8, (DK + DV) // 64
    ldq = 2 * H * DK + HV * DV
    for h in range(HV):
        kh = h // (HV // H)
        for ci in range(nc):
            c0, n = chunk_span(ci, nlanes, pos0)
            Y = np.zeros((C, DK + DV), np.float32)
            rows = qkvn[c0 : c0 + n]
            Y[:n, :DK] = rows[:, H * DK + kh * DK : H * DK + (kh + 1) * DK]
            Y[:n, DK:] = rows[:, 2 * H * DK + h * DV : 2 * H * DK + (h + 1) * DV]
            sG = np.zeros(C, np.float32)
            sB = np.zeros(C, np.float32)
            sG[:n], sB[:n] = gb[c0 : c0 + n, h], gb[c0 : c0 + n, HV + h]
            sG, sGl = cumsum_scan(sG)
            sA = np.full((C, C), np.nan, np.float32)
            for tm in range(4):
                for tn in range(8):
                    kk = np.zeros((4, 32), np.float32)
                    if tn * 8 <= tm * 16 + 15:
                        for s in range(DK // 8):
                            col = 8 * s + 2 * TQ
                            a02 = Y[tm * 16 + GQ, col], Y[tm * 16 + GQ, col + 1]
                            a13 = Y[tm * 16 + GQ + 8, col], Y[tm * 16 + GQ + 8, col + 1]
                            mma3(kk, [a02[0], a13[0], a02[1], a13[1]], Y[tn * 8 + GQ, col], Y[tn * 8 + GQ, col + 1])
                    for e in range(4):
                        i, m = tm * 16 + GQ + (e >> 1) * 8, tn * 8 + 2 * TQ + (e & 1)
                        with np.errstate(over="ignore"):  # m > i is masked below
                            dec = np.exp(gdiff(sG, sGl, i, m)).astype(np.float32)
                        sA[i, m] = np.where(m < i, sB[i] * dec * kk[e], 0)
            gs = gsc[(h * nc + ci) * GATES * C : (h * nc + ci + 1) * GATES * C]
            eg = np.exp((sG + sGl).astype(np.float32)).astype(np.float32)
            gs[:C], gs[C : 2 * C] = sG, sGl
            gs[2 * C : 3 * C] = np.exp(gdiff(sG, sGl, C - 1, np.arange(C))).astype(np.float32)
            gs[3 * C :] = eg
            sT = np.zeros((C, 16), np.float32)
            for b in range(4):
                a = sA[b * 16 : b * 16 + 16, b * 16 : b * 16 + 16]
                for jj in range(16):
                    tc = np.zeros(16, np.float32)
                    for i in range(16):
                        acc = np.float32(1.0 if i == jj else 0.0)
                        for m in range(i):
                            acc = np.float32(acc - np.float64(a[i, m]) * tc[m])  # fmaf: one rounding
                        tc[i] = acc
                    sT[b * 16 : b * 16 + 16, jj] = tc
            Y[:, :DK] *= (sB * eg)[:, None]
            Y[:, DK:] *= sB[:, None]
            for w in range(NW):
                cols = w * NT * 8
                for b in range(4):
                    z = np.zeros((NT, 4, 32), np.float32)
                    for k0 in range(0, b * 16, 8):  # warp_mma_std: A = sA rows of block b, B = Y rows
                        a = [sA[b * 16 + GQ, k0 + TQ], sA[b * 16 + GQ + 8, k0 + TQ], sA[b * 16 + GQ, k0 + TQ + 4],
                             sA[b * 16 + GQ + 8, k0 + TQ + 4]]
                        for nt in range(NT):
                            c = cols + nt * 8 + GQ
                            mma3(z[nt], a, Y[k0 + TQ, c], Y[k0 + TQ + 4, c])
                    for nt in range(NT):
                        for e in range(4):
                            Y[b * 16 + GQ + (e >> 1) * 8, cols + nt * 8 + 2 * TQ + (e & 1)] -= z[nt, e]
                    u = np.zeros((NT, 4, 32), np.float32)
                    for k0 in (0, 8):
                        a = [sT[b * 16 + GQ, k0 + TQ], sT[b * 16 + GQ + 8, k0 + TQ], sT[b * 16 + GQ, k0 + TQ + 4],
                             sT[b * 16 + GQ + 8, k0 + TQ + 4]]
                        for nt in range(NT):
                            c = cols + nt * 8 + GQ
                            mma3(u[nt], a, Y[b * 16 + k0 + TQ, c], Y[b * 16 + k0 + TQ + 4, c])
                    for nt in range(NT):
                        for e in range(4):
                            Y[b * 16 + GQ + (e >> 1) * 8, cols + nt * 8 + 2 * TQ + (e & 1)] = u[nt, e]
            wsc[(h * nc + ci) * C * DK : (h * nc + ci + 1) * C * DK] = Y[:, :DK].reshape(-1)
            idx = np.arange(C * DV)
            e, ln, cb, rb = idx & 3, (idx >> 2) & 31, (idx >> 7) & 7, idx >> 10
            j, tok = rb * 16 + (ln >> 2) + (e >> 1) * 8, cb * 8 + 2 * (ln & 3) + (e & 1)
            usc[(h * nc + ci) * C * DV + idx] = Y[tok, DK + j]


def state_pass(state, qkvn, wsc, usc, ssc, gsc, H, HV, DK, dv, nlanes, pos0, nc, presplit=False):
    NW, KT, CT = BV // 16, DK // 8, C // 8
    ldq = 2 * H * DK + HV * dv
    st = state.reshape(-1)
    flat_q = qkvn.reshape(-1)
    for h in range(HV):
        kh = h // (HV // H)
        kbase = H * DK + kh * DK
        for bx in range(dv // BV):
            j0 = bx * BV
            S = np.zeros((NW, KT, 4, 32), np.float32)
            for w in range(NW):
                s0 = (h * dv + j0 + w * 16 + GQ) * DK + 2 * TQ
                for s in range(KT):
                    S[w, s] = st[s0 + 8 * s], st[s0 + 8 * s + 1], st[s0 + 8 * DK + 8 * s], st[s0 + 8 * DK + 8 * s + 1]
            for ci in range(nc):
                c0, n = chunk_span(ci, nlanes, pos0)
                sW = np.full(C * DK, np.nan, np.float32)
                sK = np.full(C * DK, np.nan, np.float32)
                wb = (h * nc + ci) * C * DK
                for i in range(C):
                    for c in range(0, DK, 4):
                        sW[i * DK + sw_row(i, c) + np.arange(4)] = wsc[wb + i * DK + c + np.arange(4)]
                        sK[i * DK + sw_col(i, c) + np.arange(4)] = (
                            flat_q[(c0 + i) * ldq + kbase + c + np.arange(4)] if i < n else 0)
                sKp = k_pairs(sK, DK) if presplit else None
                ub = (h * nc + ci) * C * dv + j0 * C
                sU = usc[ub : ub + C * BV].copy()
                sE = gsc[(h * nc + ci) * GATES * C + 2 * C : (h * nc + ci + 1) * GATES * C].copy()  # ED, EG
                for w in range(NW):
                    sc = (((h * nc + ci) * (dv // 16) + j0 // 16 + w) * KT) * 128 + np.arange(32) * 4
                    for s in range(KT):
                        for e in range(4):
                            ssc[sc + s * 128 + e] = S[w, s, e]
                    p = np.zeros((CT, 4, 32), np.float32)
                    for s in range(KT):
                        a = ctile_a(S[w, s])
                        for nt in range(CT):
                            row = nt * 8 + GQ
                            ad = row * DK + sw_row(row, 8 * s + 2 * TQ)
                            mma3(p[nt], a, sW[ad], sW[ad + 1])
                    vn = ub + (w * CT * 32 + np.arange(32)) * 4
                    for nt in range(CT):
                        u = [sU[((w * CT + nt) * 32 + np.arange(32)) * 4 + e] for e in range(4)]
                        v = [(u[e] - p[nt, e]).astype(np.float32) for e in range(4)]
                        for e in range(4):
                            usc[vn + nt * 128 + e] = v[e]
                        e0, e1 = sE[nt * 8 + 2 * TQ], sE[nt * 8 + 2 * TQ + 1]
                        p[nt] = v[0] * e0, v[1] * e1, v[2] * e0, v[3] * e1
                    S[w] *= sE[2 * C - 1]
                    for m in range(CT):
                        a = ctile_a(p[m])
                        r0 = m * 8 + 2 * TQ
                        for s in range(KT):
                            if presplit:
                                at = k_pair_at(r0, 8 * s + GQ, DK)
                                mma3(S[w, s], a, sKp[at], sKp[at + 1])
                            else:
                                col = sw_col(r0, 8 * s + GQ)
                                mma3(S[w, s], a, sK[r0 * DK + col], sK[(r0 + 1) * DK + col])
            for w in range(NW):
                s1 = (h * dv + j0 + w * 16 + GQ) * DK + 2 * TQ
                for s in range(KT):
                    st[s1 + 8 * s], st[s1 + 8 * s + 1], st[s1 + 8 * DK + 8 * s], st[s1 + 8 * DK + 8 * s + 1] = S[w, s]


def out_pass(qkvn, usc, ssc, gsc, out, ldo, H, HV, DK, DV, nlanes, pos0, nc):
    NW, KT, CT = DV // 16, DK // 8, C // 8
    ldq = 2 * H * DK + HV * DV
    for h in range(HV):
        kh = h // (HV // H)
        for ci in range(nc):
            c0, n = chunk_span(ci, nlanes, pos0)
            sQ = np.full(C * DK, np.nan, np.float32)
            sK = np.full(C * DK, np.nan, np.float32)
            for i in range(C):
                for c in range(0, DK, 4):
                    q4 = qkvn[c0 + i, kh * DK + c : kh * DK + c + 4] if i < n else 0
                    k4 = qkvn[c0 + i, H * DK + kh * DK + c : H * DK + kh * DK + c + 4] if i < n else 0
                    sQ[i * DK + sw_row(i, c) + np.arange(4)] = q4
                    sK[i * DK + sw_row(i, c) + np.arange(4)] = k4
            gs = gsc[(h * nc + ci) * GATES * C : (h * nc + ci + 1) * GATES * C]
            sG, sGl, sEG = gs[:C], gs[C : 2 * C], gs[3 * C :]
            sM = np.full((C, C + 8), np.nan, np.float32)
            for tm in range(4):
                for tn in range(8):
                    if tn * 8 > tm * 16 + 15:
                        continue
                    qk = np.zeros((4, 32), np.float32)
                    for s in range(KT):
                        ra, rb, col = tm * 16 + GQ, tn * 8 + GQ, 8 * s + 2 * TQ
                        a02 = ra * DK + sw_row(ra, col)
                        a13 = (ra + 8) * DK + sw_row(ra + 8, col)
                        b = rb * DK + sw_row(rb, col)
                        mma3(qk, [sQ[a02], sQ[a13], sQ[a02 + 1], sQ[a13 + 1]], sK[b], sK[b + 1])
                    for e in range(4):
                        i, m = tm * 16 + GQ + (e >> 1) * 8, tn * 8 + 2 * TQ + (e & 1)
                        dec = np.exp(gdiff(sG, sGl, i, np.minimum(m, i))).astype(np.float32)
                        sM[i, m] = np.where(m <= i, dec * qk[e], 0)
            for w in range(NW):
                o = np.zeros((CT, 4, 32), np.float32)
                sc = (((h * nc + ci) * NW + w) * KT) * 128 + np.arange(32) * 4
                for s in range(KT):
                    f = [ssc[sc + s * 128 + e] for e in range(4)]
                    for nt in range(CT):
                        row = nt * 8 + GQ
                        ad = row * DK + sw_row(row, 8 * s + 2 * TQ)
                        mma3(o[nt], ctile_a(f), sQ[ad], sQ[ad + 1])
                for nt in range(CT):
                    e0, e1 = sEG[nt * 8 + 2 * TQ], sEG[nt * 8 + 2 * TQ + 1]
                    o[nt] = o[nt, 0] * e0, o[nt, 1] * e1, o[nt, 2] * e0, o[nt, 3] * e1
                vb = (h * nc + ci) * C * DV + (w * CT * 32 + np.arange(32)) * 4
                for mb in range(CT):
                    f = [usc[vb + mb * 128 + e] for e in range(4)]
                    for nt in range(mb, CT):
                        mma3(o[nt], ctile_a(f), sM[nt * 8 + GQ, mb * 8 + 2 * TQ], sM[nt * 8 + GQ, mb * 8 + 2 * TQ + 1])
                for nt in range(CT):
                    for e in range(4):
                        i, j = nt * 8 + 2 * TQ + (e & 1), w * 16 + GQ + (e >> 1) * 8
                        ok = i < n
                        out[c0 + i[ok], h * DV + j[ok]] = o[nt, e, ok]


def scratch_floats(nc, HV, DK, DV):
    """W, U / V_new, S_c, gates (kernels.gdn_chunk2_scratch_floats)."""
    return HV * nc * (C * DK + C * DV + DV * DK + GATES * C)


def run(state, qkvn, gb, out, ldo, H, HV, DK, DV, nlanes, pos0, presplit=False):
    """The three launches of kernels.gdn_prefill_chunked2 on poisoned scratch (presplit: the state
    pass's K pair layout)."""
    nc = nchunks(nlanes, pos0)
    scr = np.full(scratch_floats(nc, HV, DK, DV), np.nan, np.float32)
    o1 = HV * nc * C * DK
    o2 = o1 + HV * nc * C * DV
    o3 = o2 + HV * nc * DV * DK
    wsc, usc, ssc, gsc = scr[:o1], scr[o1:o2], scr[o2:o3], scr[o3:]
    prep(qkvn, gb, wsc, usc, gsc, H, HV, DK, DV, nlanes, pos0, nc)
    state_pass(state, qkvn, wsc, usc, ssc, gsc, H, HV, DK, DV, nlanes, pos0, nc, presplit)
    out_pass(qkvn, usc, ssc, gsc, out, ldo, H, HV, DK, DV, nlanes, pos0, nc)
