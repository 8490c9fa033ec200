"""A numpy transliteration of cuda/attention.cu attn_mma_body + attn_mma_combine, lane by lane.

Shared-memory tiles are filled through the kernel's own staging formula (chunk c of row r at
chunk c ^ (r & SWZ); fp8 codes staged flat, then converted into the swizzled tile: K as f16, V as bf16, exact values), read
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


def f16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


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
            vals = F.e4m3_decode(flat[r * hd + c * 16: r * hd + c * 16 + 16])  # exact in f16 (K) and bf16 (V)
            for half in range(2):
                cs = (2 * c + half) ^ (r & swz)
                tile[r * hd + cs * 8: r * hd + cs * 8 + 8] = vals[half * 8: half * 8 + 8]
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
                        rnd = f16 if fp8 else bf16  # fp8 K: the S^T mma runs in f16
                        qh[ks, :, h] = rnd(v)
                        ql[ks, :, h] = rnd(v - qh[ks, :, h]) if qsplit else 0
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
                            ksc = scale * np.exp2(np.stack([ex(kx, pa), ex(kx, pb)], 1)).astype(np.float32)
                            vsc = np.exp2(np.stack([ex(vx, pa), ex(vx, pb)], 1)).astype(np.float32)
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


# ---------------------------------------------------------------- index math only (any shape, no compute)
# Every address attn_mma_body (and, for comparison, attn_split_body) forms, transliterated from the kernel
# and checked against the extent of what it addresses: the K / V caches and their row exponents, q, the
# partials, and each shared-memory region. Cheap enough for the 27B shapes at 128K+ positions (a few
# million offsets per launch), where the full transliteration above would take hours.
I32_MAX = 2**31 - 1


class Extents:
    """Collects out-of-range or misaligned accesses as (what, detail) pairs."""

    def __init__(self):
        self.bad: list[tuple[str, str]] = []

    def within(self, what: str, off, lo: int, hi: int, width: int = 1, align: int = 1) -> None:
        """Every access [off, off + width) must lie in [lo, hi) and start on an `align` boundary."""
        off = np.asarray(off, np.int64)
        if off.size == 0:
            return
        mn, mx = int(off.min()), int(off.max())
        if mn < lo or mx + width > hi:
            self.bad.append((what, f"[{mn}, {mx + width}) outside [{lo}, {hi})"))
        if align > 1 and bool((off % align).any()):
            self.bad.append((what, f"not {align}-byte aligned"))

    def int32(self, what: str, v) -> None:
        """A value the kernel computes in 32-bit int must fit one."""
        v = np.asarray(v, np.int64)
        if v.size and (int(v.max()) > I32_MAX or int(v.min()) < -I32_MAX - 1):
            self.bad.append((what, f"{int(v.min())}..{int(v.max())} overflows int32"))


def mma_index_check(hd: int, nq: int, nkv: int, nlanes: int, pos0: int, span: int, nsplit: int, max_pos: int,
                    fp8: bool, part_lanes: int | None = None, part_nsplit: int | None = None,
                    q_rows: int | None = None, ldq: int | None = None, heads=None) -> list[tuple[str, str]]:
    """The accesses of one attention_mma launch (kernel + attn_mma_combine) that fall outside their
    buffers. Buffers as kernels.attention_mma documents them: kc / vc [nkv][max_pos][hd] (bf16 or u8),
    kx / vx [nkv][max_pos], q [q_rows][ldq] fp32, part attention_partials_floats(part_lanes, nq, hd,
    part_nsplit), dynamic smem attention_mma_shared_bytes(hd, fp8, max_pos, span, nsplit).
    heads: the kv heads to trace (default the first and the last: every offset is affine in g)."""
    kt, stages, nrow = C.ATTD_KT, C.ATTD_STAGES, C.ATTD_ROWS
    ch = hd // 8
    swz = min(ch, 8) - 1
    tile_n = kt * hd
    ks_n = hd // 16
    eb = 1 if fp8 else 2
    chs = hd * eb // 16
    stage_bytes = 2 * tile_n * eb
    part_lanes = nlanes if part_lanes is None else part_lanes
    part_nsplit = nsplit if part_nsplit is None else part_nsplit
    ldq = nq * hd if ldq is None else ldq
    q_rows = nlanes if q_rows is None else q_rows
    smem = K.attention_mma_shared_bytes(hd, fp8, max_pos, span, nsplit)
    ring = stages * stage_bytes
    cvt_base = ring                      # fp8: the converted bf16 K, V tiles (2 * TILE u16)
    exs_base = cvt_base + 2 * 2 * tile_n  # fp8: K, V exponents [ssz] each
    kv_bytes = nkv * max_pos * hd * eb
    part_floats = K.attention_partials_floats(part_lanes, nq, hd, part_nsplit)
    ex = Extents()

    ssz = K.attention_mma_split_size(pos0, span, nsplit)
    rep = nq // nkv
    rows = nlanes * rep
    nthr = 32 * K.attention_mma_warps(nlanes, rep)
    if nthr > 32 * C.ATTD_MAX_WARPS:
        ex.bad.append(("block", f"{nthr} threads > launch bound {32 * C.ATTD_MAX_WARPS}"))
    if smem > 227 * 1024:
        ex.bad.append(("smem", f"{smem} bytes above any card's opt-in"))
    ln_ = np.arange(32)
    gq, tq = ln_ >> 2, ln_ & 3
    length = pos0 + nlanes
    u = np.arange(2 * kt * chs)
    which, rem = u // (kt * chs), u % (kt * chs)
    r_u, c_u = (rem // chs)[None], (rem % chs)[None]
    which = which[None]
    # the CTAs (g, sp) that run: start = sp * ssz < pos0 + nlanes; their tiles, all splits at once
    sps = np.arange(nsplit)
    sps = sps[sps * ssz < length]
    ex.int32("start", sps * ssz)
    starts, ends = sps * ssz, np.minimum(sps * ssz + ssz, length)
    ntiles = -(-(ends - starts) // kt)
    t_split = np.repeat(np.arange(sps.size), ntiles)            # split of each tile
    t_idx = np.arange(t_split.size) - np.repeat(np.cumsum(ntiles) - ntiles, ntiles)  # tile within its split
    t_start, t_end = starts[t_split][:, None], ends[t_split][:, None]
    slot = ((t_idx % stages) * stage_bytes)[:, None]
    # issue(): 16-byte cp.async per (which, row, chunk), zero-filled (address still formed) past end
    p = t_start + t_idx[:, None] * kt + r_u
    ex.int32("issue p", p)
    ok = p < t_end
    cs = c_u if fp8 else c_u ^ (r_u & swz)
    dst = slot + which * tile_n * eb + r_u * (hd * eb) + cs * 16
    ex.within("cp.async ring slot", dst, 0, ring, 16, 16)
    ex.within("cp.async stays in its slot", dst - slot, 0, stage_bytes, 16)
    for g in (sorted({0, nkv - 1}) if heads is None else heads):
        base = g * max_pos * hd * eb
        src = base + np.where(ok, p, t_start) * (hd * eb) + c_u * 16
        ex.within("cp.async K/V source", src, 0, kv_bytes, 16, 16)
        if fp8:
            pe = starts[:, None] + np.arange(ssz)[None]
            ex.within("kx / vx rows", (g * max_pos + pe)[pe < ends[:, None]], 0, nkv * max_pos)
    if fp8:
        i = np.arange(ssz)
        ex.within("exponent smem", np.concatenate([exs_base + i, exs_base + ssz + i]), 0, smem)
        # conversion: flat codes of the slot -> swizzled bf16 tile
        rd = which * tile_n + r_u * hd + c_u * 16
        ex.within("fp8 stage read", rd, 0, stage_bytes, 16, 16)
        for half in range(2):
            wr = cvt_base + 2 * (which * tile_n + r_u * hd + (((2 * c_u + half) ^ (r_u & swz)) << 3))
            ex.within("bf16 conversion tile", wr, cvt_base, cvt_base + 4 * tile_n, 16, 16)
    # ldmatrix rows (16 bytes each) of the K / V tile the warps read, relative to the tile's base
    # (the ring slot for bf16, the converted tile for fp8)
    for mi in range(kt // 16):
        for s in range(ks_n):
            k_addr = 2 * hd * (ln_ & 15) + mi * 32 * hd + swz_off(2 * s + (ln_ >> 4), ln_, swz) * 2
            ex.within("ldmatrix K", k_addr, 0, 2 * tile_n, 16, 16)
            v_addr = (2 * tile_n + 2 * hd * ((ln_ & 7) + ((ln_ >> 4) << 3)) + mi * 32 * hd
                      + swz_off(2 * s + ((ln_ >> 3) & 1), ln_, swz) * 2)
            ex.within("ldmatrix V", v_addr, 2 * tile_n, 4 * tile_n, 16, 16)
        if fp8:  # exponent reads of the step's positions pa = p0 + mi*16 + gq, pb = pa + 8 (minus start)
            pa = t_idx[:, None] * kt + mi * 16 + gq[None]
            ex.within("exponent smem index", np.concatenate([pa, pa + 8]), 0, ssz)
    # Q fragments (float2) and partials of the active warps' rows, every running split
    for g in (sorted({0, nkv - 1}) if heads is None else heads):
        for warp in range(nthr // 32):
            if warp * nrow >= rows:
                continue
            r = warp * nrow + gq
            okr = r < rows
            lnr = np.where(okr, r // rep, 0)
            j = np.where(okr, r - lnr * rep, 0)
            qoff = (lnr * ldq + (g * rep + j) * hd + 2 * tq)[okr]
            for s in range(ks_n):
                for h in range(2):
                    ex.within("q float2", (qoff + s * 16 + h * 8) * 4, 0, q_rows * ldq * 4, 8, 8)
            for i2 in range(2):
                rr = warp * nrow + 2 * tq + i2
                okw = rr < rows
                lnw = rr // rep
                hw = g * rep + (rr - lnw * rep)
                ex.int32("part row", (lnw * nq + hw)[okw])
                dst0 = ((lnw * nq + hw)[okw][None] * nsplit + sps[:, None]) * (hd + 2)
                for dt in (0, ks_n - 1):
                    ex.within("partials", dst0 + 2 + dt * 16 + gq[okw][None] + 8, 0, part_floats)
                ex.within("partials m, l", dst0, 0, part_floats, 2)
    # attn_mma_combine: lane t reads splits 0..ns-1, each written by a CTA above (start < pos0 + nlanes)
    for t in range(nlanes):
        ns = -(-(pos0 + t + 1) // ssz)
        if ns > nsplit:
            ex.bad.append(("combine", f"lane {t} needs {ns} splits > {nsplit}"))
        if (ns - 1) * ssz >= length:
            ex.bad.append(("combine", f"lane {t} reads split {ns - 1}, never written"))
        last = ((t * nq + nq - 1) * nsplit + ns - 1) * (hd + 2) + hd + 2
        ex.within("combine partials", [last - 1], 0, part_floats)
    return ex.bad


def split_size(pos0: int, span: int) -> int:
    """cuda/attention.cu split_size (the per-lane split kernel)."""
    need = -(-(pos0 + span) // C.NSPLIT)
    return max(64, -(-need // 64) * 64)


def split_index_check(hd: int, nq: int, nkv: int, nlanes: int, pos0: int, span: int, max_pos: int, fp8: bool,
                      part_lanes: int | None = None, part_nsplit: int | None = None) -> list[tuple[str, str]]:
    """The accesses of one attention / attention_fp8 launch (attn_split_body + attn_combine) outside
    their buffers (kc / vc [nkv][max_pos][hd], kx / vx [nkv][max_pos], the partials)."""
    eb = 1 if fp8 else 2
    dpl = hd // 32
    part_lanes = nlanes if part_lanes is None else part_lanes
    part_nsplit = C.NSPLIT if part_nsplit is None else part_nsplit
    part_floats = K.attention_partials_floats(part_lanes, nq, hd, part_nsplit)
    rep = nq // nkv
    ex = Extents()
    ssz = split_size(pos0, span)
    ln_ = np.arange(32)
    for g in sorted({0, nkv - 1}):
        for t in range(nlanes):
            length = pos0 + t + 1
            for sp in range(C.NSPLIT):
                start = sp * ssz
                if start >= length:
                    continue
                end = min(start + ssz, length)
                p = np.arange(start, end)  # every warp's positions together, prefetch included (< end)
                row = (g * max_pos + p)[:, None] * hd + ln_[None] * dpl
                ex.within("K/V row", row * eb, 0, nkv * max_pos * hd * eb, dpl * eb, min(4, dpl * eb))
                if fp8:
                    ex.within("kx / vx rows", g * max_pos + p, 0, nkv * max_pos)
                dst = ((t * nq + g * rep + np.arange(rep)) * C.NSPLIT + sp) * (hd + 2)
                ex.within("partials", dst, 0, part_floats, hd + 2)
        for t in range(nlanes):
            ns = -(-(pos0 + t + 1) // ssz)
            if ns > C.NSPLIT:
                ex.bad.append(("combine", f"lane {t} needs {ns} splits > {C.NSPLIT}"))
    return ex.bad
