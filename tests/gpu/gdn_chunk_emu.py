"""A numpy transliteration of cuda/gdn_chunk.cu, lane by lane where layout matters.

It reads and writes one flat float32 "shared memory" array through the kernel's own index
formulas (ChunkSmem offsets and strides, per-warp tile assignment, the mma.sync m16n8k8 tf32
fragment map per lane, the 3xTF32 split, the cumsum scan, the blockwise triangular solve), so an index or fragment mistake in the kernel shows up here on the CPU as a
mismatch against the numpy specification (q27py/model/gdn_chunked.py). It assumes only the
PTX ISA's fragment layout; the GPU tests check the real kernel.
"""

from __future__ import annotations

import numpy as np

LANE = np.arange(32)
GQ, TQ = LANE >> 2, LANE & 3  # groupID, thread in group


def tf32(x) -> np.ndarray:
    """cvt.rna.tf32.f32: nearest, ties away from zero, 10 explicit mantissa bits."""
    b = np.asarray(x, np.float32).view(np.uint32)
    return ((b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def split(x):
    hi = tf32(x)
    return hi, tf32(np.asarray(x, np.float32) - hi)


def warp_mma(d, sm, A, ars, acs, B, brs, bcs, kdim, passes):
    """d [NT, 32 lanes, 4] += A[16 x kdim] B[kdim x 8 NT], every operand gathered per lane."""
    for k0 in range(0, kdim, 8):
        a = A + (k0 + TQ) * acs
        regs = [sm[a + GQ * ars], sm[a + (GQ + 8) * ars], sm[a + GQ * ars + 4 * acs], sm[a + (GQ + 8) * ars + 4 * acs]]
        af = np.zeros((16, 8), np.float32)
        af[GQ, TQ], af[GQ + 8, TQ], af[GQ, TQ + 4], af[GQ + 8, TQ + 4] = regs
        ah, al = split(af)
        for nt in range(d.shape[0]):
            b = B + (k0 + TQ) * brs + (nt * 8 + GQ) * bcs
            bf = np.zeros((8, 8), np.float32)
            bf[TQ, GQ], bf[TQ + 4, GQ] = sm[b], sm[b + 4 * brs]
            bh, bl = split(bf)
            prods = [al @ bh, ah @ bl, ah @ bh] if passes == 3 else [ah @ bh]
            for p in prods:
                for e in range(4):
                    d[nt, :, e] += p[GQ + (e >> 1) * 8, 2 * TQ + (e & 1)]


def frag_rows_cols(e):
    return GQ + (e >> 1) * 8, 2 * TQ + (e & 1)


def run(state, qkvn, gb, out, ldo, H, HV, DK, dv, nlanes, pos0, C=64, BV=64, NW=8, out_passes=3):
    """One launch: state [HV][dv][dk] fp32 (updated in place), out [T, ldo] (written)."""
    LDK, LDC, LDV, LDT = DK + 4, C + 4, BV + 8, 16 + 4
    oK = 0
    oQ = oK + C * LDK
    oS = oQ + C * LDK
    oA = oS + DK * LDV
    oM = oA + C * LDC
    oU = oM + C * LDC
    oG = oU + C * LDV
    oB = oG + C
    oT = oB + C
    MT, MTS = C // 16, DK // 16
    NPW, NPS = BV * MT // (8 * NW), BV * MTS // (8 * NW)
    ldq = 2 * H * DK + HV * dv
    flat_q, flat_g, st = qkvn.reshape(-1), gb.reshape(-1), state.reshape(-1)
    for h in range(HV):
        for bx in range(dv // BV):
            sm = np.full(oT + C * LDT, np.nan, np.float32)  # poison: every read must follow a write
            j0, kh = bx * BV, h // (HV // H)
            qb, kb, vb = kh * DK, H * DK + kh * DK, 2 * H * DK + h * dv + j0
            idx = np.arange(BV * DK)
            j, kk = idx // DK, idx % DK
            sm[oS + kk * LDV + j] = st[(h * dv + j0 + j) * DK + kk]
            c0 = 0
            while c0 < nlanes:
                n = min(C - (pos0 + c0) % C, nlanes - c0)
                idx = np.arange(C * DK)
                i, kk = idx // DK, idx % DK
                ok = i < n
                rows = (c0 + np.minimum(i, n - 1)) * ldq
                sm[oK + i * LDK + kk] = np.where(ok, flat_q[kb + rows + kk], 0)
                sm[oQ + i * LDK + kk] = np.where(ok, flat_q[qb + rows + kk], 0)
                idx = np.arange(C * BV)
                i, jj = idx // BV, idx % BV
                sm[oU + i * LDV + jj] = np.where(i < n, flat_q[vb + (c0 + np.minimum(i, n - 1)) * ldq + jj], 0)
                tt = np.arange(C)
                sm[oG + tt] = np.where(tt < n, flat_g[(c0 + np.minimum(tt, n - 1)) * 2 * HV + h], 0)
                sm[oB + tt] = np.where(tt < n, flat_g[(c0 + np.minimum(tt, n - 1)) * 2 * HV + HV + h], 0)
                # warp 0 scan (shfl_up butterflies in float32, same order as the kernel)
                x0 = sm[oG + LANE].copy()
                x1 = sm[oG + (LANE + 32) % C].copy() if C > 32 else np.zeros(32, np.float32)
                o = 1
                while o < 32:
                    y0, y1 = np.roll(x0, o), np.roll(x1, o)
                    m = LANE >= o
                    x0, x1 = np.where(m, x0 + y0, x0), np.where(m, x1 + y1, x1)
                    o <<= 1
                sm[oG + LANE[LANE < C]] = x0[LANE < C]
                if C > 32:
                    sm[oG + LANE + 32] = x1 + x0[31]
                gam, bet = sm[oG : oG + C], sm[oB : oB + C]
                owners, seen = [], 0  # the kernel's round-robin of lower-triangle tiles
                for tile in range(MT * (C // 8)):
                    tm, tn = tile // (C // 8), tile % (C // 8)
                    lower = tn * 8 <= tm * 16 + 15
                    owners.append(seen % NW if lower else tile % NW)
                    seen += lower
                assert max(owners.count(w) for w in range(NW)) <= -(-MT * (C // 8) // NW) + 1
                for warp in range(NW):
                    for tile in [x for x in range(MT * (C // 8)) if owners[x] == warp]:
                        tm, tn = tile // (C // 8), tile % (C // 8)
                        kkd, qkd = np.zeros((1, 32, 4), np.float32), np.zeros((1, 32, 4), np.float32)
                        if tn * 8 <= tm * 16 + 15:
                            warp_mma(kkd, sm, oK + tm * 16 * LDK, LDK, 1, oK + tn * 8 * LDK, 1, LDK, DK, 3)
                            warp_mma(qkd, sm, oQ + tm * 16 * LDK, LDK, 1, oK + tn * 8 * LDK, 1, LDK, DK, out_passes)
                        for e in range(4):
                            r, c = frag_rows_cols(e)
                            i, m = tm * 16 + r, tn * 8 + c
                            dec = np.where(m <= i, np.exp(gam[i] - gam[np.minimum(m, i)]), 0).astype(np.float32)
                            sm[oA + i * LDC + m] = np.where(m < i, bet[i] * dec * kkd[0, :, e], 0)
                            sm[oM + i * LDC + m] = dec * qkd[0, :, e]
                ys = []
                for warp in range(NW):
                    mt, nb = warp % MT, (warp // MT) * NPW * 8
                    x, y = np.zeros((NPW, 32, 4), np.float32), np.zeros((NPW, 32, 4), np.float32)
                    warp_mma(x, sm, oK + mt * 16 * LDK, LDK, 1, oS + nb, LDV, 1, DK, 3)
                    warp_mma(y, sm, oQ + mt * 16 * LDK, LDK, 1, oS + nb, LDV, 1, DK, out_passes)
                    for nt in range(NPW):
                        for e in range(4):
                            r, c = frag_rows_cols(e)
                            i, jj = mt * 16 + r, nb + nt * 8 + c
                            eg = np.exp(gam[i]).astype(np.float32)
                            a = oU + i * LDV + jj
                            sm[a] = bet[i] * (sm[a] - eg * x[nt, :, e])
                            y[nt, :, e] *= eg
                    ys.append(y)
                # diagonal-block inverses, one thread per column (tid < C): T[i][j] = delta - sum A[i][m] T[m][j]
                for tid in range(C):
                    blk, jj = tid >> 4, tid & 15
                    a0 = oA + blk * 16 * LDC + blk * 16
                    tc = np.zeros(16, np.float32)
                    for i in range(16):
                        acc = np.float32(1.0 if i == jj else 0.0)
                        for m in range(i):
                            acc = np.float32(acc - sm[a0 + i * LDC + m] * tc[m])
                        tc[i] = acc
                    for i in range(16):
                        sm[oT + (blk * 16 + i) * LDT + jj] = tc[i]
                # blockwise solve, warp w on value columns 8w..8w+7
                for warp in range(NW):
                    nw = warp * 8
                    for blk in range(MT):
                        z = np.zeros((1, 32, 4), np.float32)
                        if blk:
                            warp_mma(z, sm, oA + blk * 16 * LDC, LDC, 1, oU + nw, LDV, 1, blk * 16, 3)
                        for e in range(4):
                            r, c = frag_rows_cols(e)
                            sm[oU + (blk * 16 + r) * LDV + nw + c] -= z[0, :, e]
                        u = np.zeros((1, 32, 4), np.float32)
                        warp_mma(u, sm, oT + blk * 16 * LDT, LDT, 1, oU + blk * 16 * LDV + nw, LDV, 1, 16, 3)
                        for e in range(4):
                            r, c = frag_rows_cols(e)
                            sm[oU + (blk * 16 + r) * LDV + nw + c] = u[0, :, e]
                for warp in range(NW):
                    mt, nb = warp % MT, (warp // MT) * NPW * 8
                    y = ys[warp]
                    warp_mma(y, sm, oM + mt * 16 * LDC, LDC, 1, oU + nb, LDV, 1, (mt + 1) * 16, out_passes)
                    for nt in range(NPW):
                        for e in range(4):
                            r, c = frag_rows_cols(e)
                            i, jj = mt * 16 + r, nb + nt * 8 + c
                            w = i < n
                            out[c0 + i[w], h * dv + j0 + jj[w]] = y[nt, w, e]
                glast = gam[n - 1]
                idx = np.arange(C * DK)
                i, kk = idx // DK, idx % DK
                sm[oK + i * LDK + kk] *= np.exp(glast - gam[i]).astype(np.float32)
                eg = np.float32(np.exp(glast))
                for warp in range(NW):
                    mts, nbs = warp % MTS, (warp // MTS) * NPS * 8
                    s = np.zeros((NPS, 32, 4), np.float32)
                    for nt in range(NPS):
                        for e in range(4):
                            r, c = frag_rows_cols(e)
                            s[nt, :, e] = eg * sm[oS + (mts * 16 + r) * LDV + nbs + nt * 8 + c]
                    warp_mma(s, sm, oK + mts * 16, 1, LDK, oU + nbs, LDV, 1, (n + 7) & ~7, 3)
                    for nt in range(NPS):
                        for e in range(4):
                            r, c = frag_rows_cols(e)
                            sm[oS + (mts * 16 + r) * LDV + nbs + nt * 8 + c] = s[nt, :, e]
                c0 += n
            idx = np.arange(BV * DK)
            j, kk = idx // DK, idx % DK
            st[(h * dv + j0 + j) * DK + kk] = sm[oS + kk * LDV + j]
