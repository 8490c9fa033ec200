"""A numpy transliteration of cuda/attention.cu attn_mma_body + attn_mma_combine, lane by lane.

Shared-memory tiles are filled through the kernel's own staging formula (chunk c of row r at
chunk c ^ (r & SWZ); fp8 codes staged flat, then converted into the swizzled bf16 tile), read
back through its ldmatrix addressing (swz_off), and every operand moves in the PTX ISA's
fragment layouts (ldmatrix / ldmatrix.trans / movmatrix.trans / mma.m16n8k16), so an index,
swizzle or fragment mistake in the kernel shows up on the CPU against float64 attention. The
mma itself is modelled as an exact sum rounded to fp32; the GPU tests check the real kernel.
"""

from __future__ import annotations

import numpy as np

from q27py.gpu import constants as C
from q27py.gpu import kernels as K
from q27py.model import kvformat as F

LANE = np.arange(32)
GQ, TQ = LANE >> 2, LANE & 3


def bf16(x) -> np.ndarray:
    return F.bf16_round(np.asarray(x, np.float32))


def ldsm(tile: np.ndarray, addr: np.ndarray, trans: bool) -> np.ndarray:
    """ldmatrix.x4 (.trans): lanes 8j..8j+7 give the row addresses (elements) of matrix j.
    Returns [32 lanes, 4 regs, 2 halves] (the low half first)."""
    out = np.zeros((32, 4, 2), np.float32)
    for j in range(4):
        mat = np.stack([tile[addr[8 * j + i]: addr[8 * j + i] + 8] for i in range(8)])  # [row][col]
        if trans:
            mat = mat.T
        out[:, j, 0] = mat[GQ, 2 * TQ]
        out[:, j, 1] = mat[GQ, 2 * TQ + 1]
    return out


def mma(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """m16n8k16: c [32, 4] fp32, a [32, 4 regs, 2], b [32, 2 regs, 2] in the ISA's fragment layout."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for r, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        for h in range(2):
            A[GQ + dr, 2 * TQ + dc + h] = a[:, r, h]
    for r in range(2):
        for h in range(2):
            B[2 * TQ + 8 * r + h, GQ] = b[:, r, h]
    D = A @ B
    d = np.stack([D[GQ, 2 * TQ], D[GQ, 2 * TQ + 1], D[GQ + 8, 2 * TQ], D[GQ + 8, 2 * TQ + 1]], axis=1)
    return (c.astype(np.float64) + d).astype(np.float32)


def movmatrix_t(x: np.ndarray) -> np.ndarray:
    """x [32, 2]: thread (g, t) holds row g, cols 2t, 2t+1 of an 8x8 matrix -> the same of its transpose."""
    M = np.zeros((8, 8), np.float32)
    M[GQ, 2 * TQ], M[GQ, 2 * TQ + 1] = x[:, 0], x[:, 1]
    return np.stack([M.T[GQ, 2 * TQ], M.T[GQ, 2 * TQ + 1]], axis=1)


def swz_off(c, lane, swz):
    return 8 * ((c & ~swz) | ((c & swz) ^ (lane & swz)))


def stage_tile(rows_src: np.ndarray, p0: int, end: int, hd: int, fp8: bool) -> np.ndarray:
    """The bf16 tile (values) a warp reads: rows_src [max_pos][hd] (bf16 values or e4m3 codes)."""
    kt = C.ATTD_KT
    ch = hd // 8
    swz = min(ch, 8) - 1
    tile = np.zeros(kt * hd, np.float32)
    if not fp8:
        for r in range(kt):
            p = p0 + r
            for c in range(ch):
                src = rows_src[p, c * 8: c * 8 + 8] if p < end else np.zeros(8, np.float32)
                cs = c ^ (r & swz)
                tile[r * hd + cs * 8: r * hd + cs * 8 + 8] = src
        return tile
    flat = np.zeros(kt * hd, np.uint8)  # codes staged flat (16-byte chunks, no swizzle)
    for r in range(kt):
        p = p0 + r
        if p < end:
            flat[r * hd: (r + 1) * hd] = rows_src[p]
    for r in range(kt):
        for c in range(hd // 16):
            vals = F.e4m3_decode(flat[r * hd + c * 16: r * hd + c * 16 + 16]) / 256.0
            for half in range(2):
                cs = (2 * c + half) ^ (r & swz)
                tile[r * hd + cs * 8: r * hd + cs * 8 + 8] = bf16(vals[half * 8: half * 8 + 8])
    return tile


def attn_mma(q, kc, vc, pos0: int, span: int, nsplit: int, nq: int, nkv: int, qsplit: bool = True, kx=None, vx=None):
    """Partials {m, l, acc} [nlanes, nq, nsplit, hd + 2] as the kernel writes them (NaN where unwritten).
    q [nlanes, nq, hd] fp32; kc / vc [nkv][max_pos][hd]: bf16 values, or e4m3 codes with kx / vx.
    qsplit: Q and P as bf16 hi + lo (the kernels without the _bq suffix), else rounded once."""
    fp8 = kx is not None
    nlanes, _, hd = q.shape
    kt, nrow = C.ATTD_KT, C.ATTD_ROWS
    swz = min(hd // 8, 8) - 1
    ks_n = hd // 16
    rep = nq // nkv
    rows = nlanes * rep
    ssz = K.attention_mma_split_size(pos0, span, nsplit)
    part = np.full((nlanes, nq, nsplit, hd + 2), np.nan, np.float32)
    scale = np.float32(hd ** -0.5)
    for g in range(nkv):
        for sp in range(nsplit):
            start = sp * ssz
            if start >= pos0 + nlanes:
                continue
            end = min(start + ssz, pos0 + nlanes)
            ntiles = -(-(end - start) // kt)
            tiles = [(stage_tile(kc[g], start + i * kt, end, hd, fp8), stage_tile(vc[g], start + i * kt, end, hd, fp8))
                     for i in range(ntiles)]
            for warp in range(K.attention_mma_warps(nlanes, rep)):
                if warp * nrow >= rows:
                    continue
                r = warp * nrow + GQ
                ok = r < rows
                ln = np.where(ok, r // rep, 0)
                j = np.where(ok, r - ln * rep, 0)
                qrow = np.where(ok[:, None], q[ln, g * rep + j], 0).astype(np.float32)
                qh = np.zeros((ks_n, 32, 2, 2), np.float32)
                ql = np.zeros_like(qh)
                for ks in range(ks_n):
                    for h in range(2):
                        col = ks * 16 + h * 8 + 2 * TQ
                        v = np.stack([qrow[LANE, col], qrow[LANE, col + 1]], 1)
                        qh[ks, :, h] = bf16(v)
                        ql[ks, :, h] = bf16(v - qh[ks, :, h]) if qsplit else 0
                rr = warp * nrow + 2 * TQ[:, None] + np.arange(2)[None]
                lim = np.where(rr < rows, pos0 + rr // rep, -1)
                o = np.zeros((ks_n, 32, 4), np.float32)
                m = np.full((32, 2), -np.inf, np.float32)
                l_ = np.zeros((32, 2), np.float32)
                k_row = (LANE & 15) * hd
                v_row = ((LANE & 7) + ((LANE >> 4) << 3)) * hd
                for ti, (kt_, vt_) in enumerate(tiles):
                    p0 = start + ti * kt
                    for mi in range(kt // 16):
                        sh = np.zeros((32, 4), np.float32)
                        sl = np.zeros((32, 4), np.float32)
                        for ks in range(ks_n):
                            a = ldsm(kt_, k_row + mi * 16 * hd + swz_off(2 * ks + (LANE >> 4), LANE, swz), False)
                            sh = mma(sh, a, qh[ks])
                            if qsplit:
                                sl = mma(sl, a, ql[ks])
                        pa = p0 + mi * 16 + GQ
                        pb = pa + 8
                        ksc = np.stack([np.full(32, scale), np.full(32, scale)], 1).astype(np.float32)
                        vsc = np.ones((32, 2), np.float32)
                        if fp8:
                            ex = lambda e, p: np.where(p < end, e[g, np.minimum(p, e.shape[1] - 1)], 0)  # noqa: E731
                            ksc = scale * np.exp2(np.stack([ex(kx, pa), ex(kx, pb)], 1) + 8).astype(np.float32)
                            vsc = np.exp2(np.stack([ex(vx, pa), ex(vx, pb)], 1) + 8).astype(np.float32)
                        x = np.zeros((32, 4), np.float32)
                        for c in range(4):
                            p = pa if c < 2 else pb
                            x[:, c] = np.where(p <= lim[:, c & 1], (sh[:, c] + sl[:, c]) * ksc[:, c >> 1], -np.inf)
                        mx = np.stack([np.maximum(x[:, 0], x[:, 2]), np.maximum(x[:, 1], x[:, 3])], 1)
                        for sh_ in (4, 8, 16):
                            mx = np.maximum(mx, mx[LANE ^ sh_])
                        mn = np.maximum(m, mx)
                        mu = np.where(mn == -np.inf, 0, mn).astype(np.float32)
                        with np.errstate(invalid="ignore"):
                            corr = np.exp(m - mu).astype(np.float32)
                        m = mn
                        l_ = l_ * corr
                        pk = np.zeros((32, 2, 2), np.float32)
                        pl = np.zeros((32, 2, 2), np.float32)
                        for h in range(2):
                            w = np.exp(np.stack([x[:, 2 * h] - mu[:, 0], x[:, 2 * h + 1] - mu[:, 1]], 1))
                            w = w.astype(np.float32)
                            if not qsplit:
                                w = bf16(w)
                            l_ = l_ + w
                            f = (w * vsc[:, h:h + 1]).astype(np.float32) if fp8 else w
                            pk[:, h] = bf16(f)
                            pl[:, h] = bf16(f - pk[:, h]) if qsplit else 0
                        b = np.stack([movmatrix_t(pk[:, 0]), movmatrix_t(pk[:, 1])], 1)
                        bl = np.stack([movmatrix_t(pl[:, 0]), movmatrix_t(pl[:, 1])], 1)
                        for dt in range(ks_n):
                            o[dt] *= np.stack([corr[:, 0], corr[:, 1], corr[:, 0], corr[:, 1]], 1)
                            a = ldsm(vt_, v_row + mi * 16 * hd + swz_off(2 * dt + ((LANE >> 3) & 1), LANE, swz), True)
                            if qsplit:
                                o[dt] = mma(o[dt], a, bl)
                            o[dt] = mma(o[dt], a, b)
                for sh_ in (4, 8, 16):
                    l_ = l_ + l_[LANE ^ sh_]
                for i in range(2):
                    for lane in range(32):
                        r_ = warp * nrow + 2 * TQ[lane] + i
                        if r_ >= rows:
                            continue
                        ln_, h_ = r_ // rep, g * rep + r_ % rep
                        dst = part[ln_, h_, sp]
                        if GQ[lane] == 0:
                            dst[0], dst[1] = m[lane, i], l_[lane, i]
                        for dt in range(ks_n):
                            dst[2 + dt * 16 + GQ[lane]] = o[dt, lane, i]
                            dst[2 + dt * 16 + GQ[lane] + 8] = o[dt, lane, 2 + i]
    return part


def combine(part: np.ndarray, pos0: int, span: int, nsplit: int, gate: np.ndarray) -> np.ndarray:
    """attn_mma_combine: [nlanes, nq, hd] gated outputs from the partials."""
    nlanes, nq, _, hd2 = part.shape
    ssz = K.attention_mma_split_size(pos0, span, nsplit)
    out = np.zeros((nlanes, nq, hd2 - 2), np.float64)
    for t in range(nlanes):
        ns = -(-(pos0 + t + 1) // ssz)
        b = part[t, :, :ns].astype(np.float64)
        M = b[:, :, 0].max(axis=1, keepdims=True)
        e = np.exp(b[:, :, 0] - M)
        out[t] = (b[:, :, 2:] * e[..., None]).sum(1) / (b[:, :, 1] * e).sum(1)[:, None]
    return out / (1 + np.exp(-gate.astype(np.float64)))
