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


def mma1(d, a, b0, b1):
    """d (4, 32) += A B as one TF32 product (mma_p<1>: the output pass's "tf32 out" class): both operands
    rounded to tf32 (rna), the product summed in wide precision and added to d in fp32."""
    af = np.zeros((16, 8), np.float32)
    af[GQ, TQ], af[GQ + 8, TQ], af[GQ, TQ + 4], af[GQ + 8, TQ + 4] = a
    bf = np.zeros((8, 8), np.float32)
    bf[TQ, GQ], bf[TQ + 4, GQ] = b0, b1
    p = tf32(af).astype(np.float64) @ tf32(bf)
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


def out_pass(qkvn, usc, ssc, gsc, out, ldo, H, HV, DK, DV, nlanes, pos0, nc, passes=3):
    """gdn2_out_d* (passes 3: mma3) or gdn2_out1_d* (passes 1: mma1, kernels.GDN2_OUT_TF32)."""
    mma = mma3 if passes == 3 else mma1
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
                        mma(qk, [sQ[a02], sQ[a13], sQ[a02 + 1], sQ[a13 + 1]], sK[b], sK[b + 1])
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
                        mma(o[nt], ctile_a(f), sQ[ad], sQ[ad + 1])
                for nt in range(CT):
                    e0, e1 = sEG[nt * 8 + 2 * TQ], sEG[nt * 8 + 2 * TQ + 1]
                    o[nt] = o[nt, 0] * e0, o[nt, 1] * e1, o[nt, 2] * e0, o[nt, 3] * e1
                vb = (h * nc + ci) * C * DV + (w * CT * 32 + np.arange(32)) * 4
                for mb in range(CT):
                    f = [usc[vb + mb * 128 + e] for e in range(4)]
                    for nt in range(mb, CT):
                        mma(o[nt], ctile_a(f), sM[nt * 8 + GQ, mb * 8 + 2 * TQ], sM[nt * 8 + GQ, mb * 8 + 2 * TQ + 1])
                for nt in range(CT):
                    for e in range(4):
                        i, j = nt * 8 + 2 * TQ + (e & 1), w * 16 + GQ + (e >> 1) * 8
                        ok = i < n
                        out[c0 + i[ok], h * DV + j[ok]] = o[nt, e, ok]


def scratch_floats(nc, HV, DK, DV):
    """W, U / V_new, S_c, gates (kernels.gdn_chunk2_scratch_floats)."""
    return HV * nc * (C * DK + C * DV + DV * DK + GATES * C)


def run(state, qkvn, gb, out, ldo, H, HV, DK, DV, nlanes, pos0, presplit=False, out_passes=3):
    """The three launches of kernels.gdn_prefill_chunked2 on poisoned scratch (presplit: the state
    pass's K pair layout; out_passes: the output pass's products, 1 under kernels.GDN2_OUT_TF32)."""
    nc = nchunks(nlanes, pos0)
    scr = np.full(scratch_floats(nc, HV, DK, DV), np.nan, np.float32)
    o1 = HV * nc * C * DK
    o2 = o1 + HV * nc * C * DV
    o3 = o2 + HV * nc * DV * DK
    wsc, usc, ssc, gsc = scr[:o1], scr[o1:o2], scr[o2:o3], scr[o3:]
    prep(qkvn, gb, wsc, usc, gsc, H, HV, DK, DV, nlanes, pos0, nc)
    state_pass(state, qkvn, wsc, usc, ssc, gsc, H, HV, DK, DV, nlanes, pos0, nc, presplit)
    out_pass(qkvn, usc, ssc, gsc, out, ldo, H, HV, DK, DV, nlanes, pos0, nc, out_passes)


# ---------------------------------------------------------------- the 8-warp state pass (state8_body)
def mma3_split_b(d, a, bh0, bl0, bh1, bl1):
    """mma3 with B given as its tf32 hi / lo halves (the presplit operands): the same three products, so
    mma3_split_b(d, a, *split(b0), *split(b1)) == mma3(d, a, b0, b1)."""
    af = np.zeros((16, 8), np.float32)
    af[GQ, TQ], af[GQ + 8, TQ], af[GQ, TQ + 4], af[GQ + 8, TQ + 4] = a
    bh, bl = np.zeros((8, 8), np.float32), np.zeros((8, 8), np.float32)
    bh[TQ, GQ], bh[TQ + 4, GQ] = bh0, bh1
    bl[TQ, GQ], bl[TQ + 4, GQ] = bl0, bl1
    ah, al = split(af)
    p = al.astype(np.float64) @ bh + ah.astype(np.float64) @ bl + ah.astype(np.float64) @ bh
    for e in range(4):
        d[e] = (d[e] + p[GQ + (e >> 1) * 8, 2 * TQ + (e & 1)]).astype(np.float32)


def wavefronts(addr, width):
    """(shared-memory wavefronts, the minimum) of one warp access: lane i reads or writes `width` consecutive
    4-byte words from word addr[i]. 4-byte accesses are served per warp, 8-byte per half warp, 16-byte per
    quarter warp; within each such phase a bank serves one distinct word per wavefront (equal words broadcast)."""
    per = 32 // width
    total = phases = 0
    for p0 in range(0, len(addr), per):
        words = np.unique((addr[p0 : p0 + per, None] + np.arange(width)).ravel())
        total += int(np.bincount(words % 32, minlength=32).max())
        phases += 1
    return total, phases


class Smem:
    """One CTA's shared memory as a flat float32 array (NaN = never written), with a happens-before race check
    between warps and per-site bank-conflict counts.

    Each warp carries a vector clock; a barrier over a set of warps (the CTA: bar.sync 0, a pair: bar.sync id, 64)
    joins their clocks and ticks each. A read races with an earlier write by another warp, and a write with an
    earlier read or write by another warp, unless that access happens before it (its warp's clock then was <= what
    the accessing warp knows of that warp). A cp.async copy is a write at its issue (the destination must be free
    then: NaN until it lands) and again when its group is waited for (it lands: readers must come after a barrier
    that follows the wait). The check does not depend on the order the emulation runs the warps in."""

    def __init__(self, nfloats, nwarps):
        self.v = np.full(nfloats, np.nan, np.float32)
        self.nw = nwarps
        self.vc = np.eye(nwarps, dtype=np.int64)
        self.wr_warp = np.full(nfloats, -1, np.int64)
        self.wr_clock = np.zeros(nfloats, np.int64)
        self.rd_clock = np.zeros((nfloats, nwarps), np.int64)
        self.open = [[] for _ in range(nwarps)]
        self.groups = [[] for _ in range(nwarps)]
        self.races = []  # (site, kind, warp, other warp, first word)
        self.sites = {}  # site -> [accesses, wavefronts, minimum wavefronts]

    def barrier(self, warps):
        w = np.asarray(warps)
        self.vc[w] = self.vc[w].max(axis=0)
        self.vc[w, w] += 1

    def _access(self, w, a, write, site):
        a = a.ravel()
        vc = self.vc[w]
        ww = self.wr_warp[a]
        m = (ww >= 0) & (ww != w)
        if m.any():
            bad = vc[ww[m]] < self.wr_clock[a[m]]
            if bad.any():
                i = np.flatnonzero(m)[np.argmax(bad)]
                self.races.append((site, "write then " + ("write" if write else "read"), w, int(ww[i]), int(a[i])))
        if write:
            rc = self.rd_clock[a].copy()
            rc[:, w] = 0
            bad = rc > vc[None, :]
            if bad.any():
                i, o = np.argwhere(bad)[0]
                self.races.append((site, "read then write", w, int(o), int(a[i])))
            self.wr_warp[a], self.wr_clock[a], self.rd_clock[a] = w, vc[w], 0
        else:
            self.rd_clock[a, w] = vc[w]

    def _banks(self, site, addr, width):
        f, m = wavefronts(addr, width)
        s = self.sites.setdefault(site, [0, 0, 0])
        s[0], s[1], s[2] = s[0] + 1, s[1] + f, s[2] + m

    def read(self, w, addr, width, site):
        """Warp w's lanes each read `width` words from addr[lane]: values [lanes, width]."""
        a = addr[:, None] + np.arange(width)
        self._access(w, a, False, site)
        self._banks(site, addr, width)
        return self.v[a]

    def write(self, w, addr, vals, site):
        a = addr[:, None] + np.arange(vals.shape[1])
        self._access(w, a, True, site)
        self._banks(site, addr, vals.shape[1])
        self.v[a] = vals

    def cp_async(self, w, addr, vals, site):
        """16-byte copies of warp w (addr: each lane's first word, vals [lanes, 4]), landing at a later wait."""
        a = addr[:, None] + np.arange(4)
        self._access(w, a, True, site + " (issue)")
        self.v[a] = np.nan
        self.open[w].append((a, np.asarray(vals, np.float32), site))

    def commit(self, w):
        self.groups[w].append(self.open[w])
        self.open[w] = []

    def wait(self, w, n):
        """cp.async.wait_group n by warp w: all but its newest n groups have landed."""
        while len(self.groups[w]) > n:
            for a, vals, site in self.groups[w].pop(0):
                self._access(w, a, True, site + " (landed)")
                self.v[a] = vals


def state_pass8(state, qkvn, wsc, usc, ssc, gsc, H, HV, DK, dv, nlanes, pos0, nc, presplit=0, stages=2, faults=(),
                report=None):
    """state8_body: the 8-warp state pass (pairs of warps, each half on half of each product's columns), with the
    kernel's shared memory (StateSmem regions, cp.async stages, presplit buffer) emulated through Smem: every
    shared read and write goes through the kernel's own index formulas, every barrier is modelled. presplit: the
    kernel's SPLIT (0: none, 1: K presplit, 2: W and K presplit; the tf32 hi / lo bit patterns stored as the
    kernel stores them). Bitwise state_pass by construction of the kernel (tested). report: a dict that
    receives the races and the per-site bank-conflict counts of every CTA. faults: barriers left out or
    narrowed ("pair": the S^T exchange's pair barrier; "vnew": the CTA barrier after V_new as a pair barrier;
    "end": the chunk's closing barrier), for the tests that the race check sees them."""
    NQ, KT, CT = BV // 16, DK // 8, C // 8
    NW, KH, CH = 2 * NQ, KT // 2, CT // 2
    oW, oK = 0, C * DK
    oU = oK + C * DK
    oE = oU + C * BV
    STAGE = oE + 2 * C
    LO = stages * STAGE  # presplit 2: W lo, then K lo; 1: K lo
    KLO = LO + (C * DK if presplit == 2 else 0)
    ar4 = np.arange(4)
    ldq = 2 * H * DK + HV * dv
    st = state.reshape(-1)
    flat_q = qkvn.reshape(-1)
    races, sites = [], {}
    for h in range(HV):
        kh = h // (HV // H)
        kbase = H * DK + kh * DK
        for bx in range(dv // BV):
            j0 = bx * BV
            sm = Smem(stages * STAGE + presplit * C * DK, NW)
            allw = list(range(NW))

            def issue(ci, stg):
                base = stg * STAGE
                c0, n = chunk_span(ci, nlanes, pos0)
                wb = (h * nc + ci) * C * DK
                ub = (h * nc + ci) * C * dv + j0 * C
                eb = (h * nc + ci) * GATES * C + 2 * C
                for w in allw:
                    tid = 32 * w + np.arange(32)
                    for i0 in range(0, C * DK // 4, NW * 32):
                        idx = i0 + tid
                        idx = idx[idx < C * DK // 4]
                        i = idx // (DK // 4)
                        c = (idx - i * (DK // 4)) * 4
                        sm.cp_async(w, base + oW + i * DK + sw_row(i, c), wsc[wb + (i * DK + c)[:, None] + ar4], "W")
                        ok = i < n
                        src = (c0 + np.where(ok, i, 0)) * ldq + kbase + c
                        sm.cp_async(w, base + oK + i * DK + sw_col(i, c),
                                    np.where(ok[:, None], flat_q[src[:, None] + ar4], 0), "K")
                    for i0 in range(0, C * BV // 4, NW * 32):
                        idx = i0 + tid
                        idx = idx[idx < C * BV // 4]
                        sm.cp_async(w, base + oU + idx * 4, usc[ub + idx[:, None] * 4 + ar4], "U")
                    idx = tid[tid < 2 * C // 4]
                    if len(idx):
                        sm.cp_async(w, base + oE + idx * 4, gsc[eb + idx[:, None] * 4 + ar4], "E")
                    sm.commit(w)

            def split_w(stg, w):  # state_split_w, warp w's threads
                base, tid = stg * STAGE, 32 * w + np.arange(32)
                for i0 in range(0, C * DK, NW * 32 * 4):
                    idx = i0 + tid * 4
                    idx = idx[idx < C * DK]
                    hi, lo = split(sm.read(w, base + oW + idx, 4, "split W: ld"))
                    sm.write(w, base + oW + idx, hi, "split W: hi st")
                    sm.write(w, LO + idx, lo, "split W: lo st")

            def split_k(stg, w):  # state_split_k, warp w's threads
                base, tid = stg * STAGE, 32 * w + np.arange(32)
                for u0 in range(0, (C // 2) * (DK // 8), NW * 32):
                    u = u0 + tid
                    sw = ((tid >> 2) & 1)[u < (C // 2) * (DK // 8)]
                    u = u[u < (C // 2) * (DK // 8)]
                    r0, c = 2 * (u // (DK // 8)), 8 * (u % (DK // 8))
                    a0, a1 = r0 * DK + sw_col(r0, c + 4 * sw), r0 * DK + sw_col(r0, c + 4 * (1 - sw))
                    A, B, Cr, D = (sm.read(w, base + oK + a, 4, "split K: ld") for a in (a0, a1, a0 + DK, a1 + DK))
                    P = np.stack([A[:, 0], Cr[:, 0], A[:, 1], Cr[:, 1]], axis=1)
                    X = np.stack([A[:, 2], Cr[:, 2], A[:, 3], Cr[:, 3]], axis=1)
                    Y = np.stack([B[:, 0], D[:, 0], B[:, 1], D[:, 1]], axis=1)
                    V = np.stack([B[:, 2], D[:, 2], B[:, 3], D[:, 3]], axis=1)
                    s1 = sw[:, None] == 1
                    for at, x in zip((a0, a1, a0 + DK, a1 + DK),
                                     (np.where(s1, V, P), np.where(s1, Y, X), np.where(s1, X, Y), np.where(s1, P, V))):
                        hi, lo = split(x)
                        sm.write(w, base + oK + at, hi, "split K: hi st")
                        sm.write(w, KLO + at, lo, "split K: lo st")

            S = np.zeros((NW, KT, 4, 32), np.float32)
            T = np.zeros((NW, KH, 4, 32), np.float32)
            for w in allw:
                q, f = w >> 1, w & 1
                s0 = (h * dv + j0 + q * 16 + GQ) * DK + 2 * TQ
                for s in range(KT):
                    S[w, s] = st[s0 + 8 * s], st[s0 + 8 * s + 1], st[s0 + 8 * DK + 8 * s], st[s0 + 8 * DK + 8 * s + 1]
                for s in range(KH):
                    o = 8 * (KH * f + s)
                    T[w, s] = st[s0 + o], st[s0 + o + 1], st[s0 + 8 * DK + o], st[s0 + 8 * DK + o + 1]
            issue(0, 0)
            if stages == 2 and nc > 1:
                issue(1, 1)
            for ci in range(nc):
                stg = ci & 1 if stages == 2 else 0
                base = stg * STAGE
                if stages == 1 or ci == 0:
                    if stages == 1 and ci > 0:
                        issue(ci, 0)
                    for w in allw:
                        sm.wait(w, 1 if stages == 2 and nc > 1 else 0)
                    sm.barrier(allw)
                if presplit == 2:
                    for w in allw:
                        split_w(stg, w)
                    sm.barrier(allw)
                for w in allw:
                    if presplit:
                        split_k(stg, w)
                    q, f = w >> 1, w & 1
                    sc = ((((h * nc + ci) * (dv // 16) + j0 // 16 + q) * KT + KH * f) * 128) + np.arange(32) * 4
                    for s in range(KH):
                        for e in range(4):
                            ssc[sc + s * 128 + e] = T[w, s, e]
                    p = np.zeros((CH, 4, 32), np.float32)
                    wrow = 8 * CH * f * DK
                    for s in range(KT):
                        a = ctile_a(S[w, s])
                        for nt in range(CH):
                            row = nt * 8 + GQ
                            at = wrow + row * DK + sw_row(row, 8 * s + 2 * TQ)
                            if presplit == 2:
                                bh = sm.read(w, base + oW + at, 2, "P: W hi ld")
                                bl = sm.read(w, LO + at, 2, "P: W lo ld")
                                mma3_split_b(p[nt], a, bh[:, 0], bl[:, 0], bh[:, 1], bl[:, 1])
                            else:
                                b = sm.read(w, base + oW + at, 2, "P: W ld")
                                mma3(p[nt], a, b[:, 0], b[:, 1])
                    ut = (q * CT + CH * f) * 32 + np.arange(32)
                    vn = (h * nc + ci) * C * dv + j0 * C + ut * 4
                    for nt in range(CH):
                        u = sm.read(w, base + oU + ut * 4 + nt * 128, 4, "V_new: U ld")
                        v = [(u[:, e] - p[nt, e]).astype(np.float32) for e in range(4)]
                        for e in range(4):
                            usc[vn + nt * 128 + e] = v[e]
                        tok = (CH * f + nt) * 8 + 2 * TQ
                        e0 = sm.read(w, base + oE + tok, 1, "ED ld")[:, 0]
                        e1 = sm.read(w, base + oE + tok + 1, 1, "ED ld")[:, 0]
                        scaled = np.stack([v[0] * e0, v[1] * e1, v[2] * e0, v[3] * e1], axis=1)
                        sm.write(w, base + oU + ut * 4 + nt * 128, scaled, "V_new: scaled st")
                if "vnew" in faults:
                    for q in range(NQ):
                        sm.barrier([2 * q, 2 * q + 1])
                else:
                    sm.barrier(allw)
                for w in allw:
                    q, f = w >> 1, w & 1
                    egl = sm.read(w, np.full(32, base + oE + 2 * C - 1), 1, "EGL ld")[:, 0]
                    T[w] *= egl
                    kcol = (DK // 2) * f
                    for m in range(CT):
                        a4 = sm.read(w, base + oU + (q * CT * 32 + np.arange(32)) * 4 + m * 128, 4, "update: V_new ld")
                        a = [a4[:, 0], a4[:, 2], a4[:, 1], a4[:, 3]]
                        r0 = m * 8 + 2 * TQ
                        for s in range(KH):
                            if presplit:
                                at = k_pair_at(r0, 8 * s + GQ, DK) + kcol
                                bh = sm.read(w, base + oK + at, 2, "update: K hi ld")
                                bl = sm.read(w, KLO + at, 2, "update: K lo ld")
                                mma3_split_b(T[w, s], a, bh[:, 0], bl[:, 0], bh[:, 1], bl[:, 1])
                            else:
                                col = sw_col(r0, 8 * s + GQ) + kcol
                                b0 = sm.read(w, base + oK + r0 * DK + col, 1, "update: K ld")[:, 0]
                                b1 = sm.read(w, base + oK + (r0 + 1) * DK + col, 1, "update: K ld")[:, 0]
                                mma3(T[w, s], a, b0, b1)
                if ci + 1 < nc:
                    for w in allw:
                        q, f = w >> 1, w & 1
                        sx = base + oW + (q * KT * 32 + np.arange(32)) * 4
                        for s in range(KH):
                            sm.write(w, sx + (KH * f + s) * 128, T[w, s].T, "S exchange st")
                    if "pair" not in faults:
                        for q in range(NQ):
                            sm.barrier([2 * q, 2 * q + 1])
                    for w in allw:
                        q = w >> 1
                        sx = base + oW + (q * KT * 32 + np.arange(32)) * 4
                        for s in range(KT):
                            S[w, s] = sm.read(w, sx + s * 128, 4, "S exchange ld").T
                        if stages == 2:
                            sm.wait(w, 0)
                    if "end" not in faults:
                        sm.barrier(allw)
                    if stages == 2 and ci + 2 < nc:
                        issue(ci + 2, stg)
            for w in allw:
                q, f = w >> 1, w & 1
                s1 = (h * dv + j0 + q * 16 + GQ) * DK + 2 * TQ + 8 * KH * f
                for s in range(KH):
                    st[s1 + 8 * s], st[s1 + 8 * s + 1], st[s1 + 8 * DK + 8 * s], st[s1 + 8 * DK + 8 * s + 1] = T[w, s]
            races += [(h, bx, *r) for r in sm.races]
            for k, v in sm.sites.items():
                acc = sites.setdefault(k, [0, 0, 0])
                for i in range(3):
                    acc[i] += v[i]
    if report is not None:
        report["races"], report["sites"] = races, sites
