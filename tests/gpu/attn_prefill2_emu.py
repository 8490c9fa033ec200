"""numpy models of cuda/attention_prefill2.cu (prefill attention v2), for CPU tests.

Two halves:
  * layout: the swizzled shared-memory tiles and the ldmatrix lane addresses, transliterated from
    the kernel (Pf2Swz::off, a_row / b_key / v_key ...), gathered through the PTX ISA's ldmatrix and
    mma.m16n8k16 fragment maps, so an index, swizzle or fragment mistake shows up as a wrong
    operand matrix -- and the 8 addresses of each ldmatrix phase are checked to hit distinct banks;
  * numerics: the kernel's arithmetic, vectorized over rows: Q rounded to bf16 once, K/V as stored
    (bf16 or fp8 x 2^e: exact in bf16), fp32 S per key tile, online softmax in log2 units, P rounded
    to bf16 with the row sum l over the rounded P, absolute key blocks of PF2_SPLIT_KEYS merged in
    block order. Used to derive the v2 tolerance against float64 attention (the mma's own fp32
    summation order is not modelled: it is ~2^-24 relative, far below the bf16 terms).
"""

from __future__ import annotations

import numpy as np

from q27py.gpu import layout as L

LANE = np.arange(32)
GQ, TQ = LANE >> 2, LANE & 3
LOG2E = 1.4426950408889634


def bf16(x) -> np.ndarray:
    return L.bf16_to_f32(L.bf16_bits(np.asarray(x, np.float32)))


# ---------------------------------------------------------------- layout
def swz_off(hd: int, r, c):
    """Pf2Swz<HD>::off: u16 offset of 16-byte chunk c of row r."""
    C = hd // 8
    sh = 0 if C >= 8 else (1 if C == 4 else 2)
    mask = (8 if C >= 8 else C) - 1
    r, c = np.asarray(r), np.asarray(c)
    return r * hd + ((c ^ ((r >> sh) & mask)) << 3)


def store_tile(mat: np.ndarray) -> np.ndarray:
    """A [rows][hd] matrix written chunk by chunk at the swizzled offsets (cp.async / st.shared)."""
    rows, hd = mat.shape
    sm = np.full(rows * hd, np.nan, np.float32)
    for r in range(rows):
        for c in range(hd // 8):
            o = int(swz_off(hd, r, c))
            sm[o : o + 8] = mat[r, 8 * c : 8 * c + 8]
    assert not np.isnan(sm).any(), "the swizzle left a hole (two chunks on one place)"
    return sm


def ldmatrix_x4(sm: np.ndarray, addr: np.ndarray, trans: bool) -> np.ndarray:
    """ldmatrix.x4 (.trans): addr[32] u16 offsets of the 8-element rows (lane 8i+j: row j of
    matrix i) -> regs [4][32][2] (register i of each lane, two b16 halves: low, high)."""
    out = np.empty((4, 32, 2), np.float32)
    for i in range(4):
        m = np.stack([sm[addr[8 * i + j] : addr[8 * i + j] + 8] for j in range(8)])  # [row j][col]
        if trans:
            m = m.T
        out[i, :, 0] = m[GQ, 2 * TQ]
        out[i, :, 1] = m[GQ, 2 * TQ + 1]
    return out


def bank_groups_ok(addr: np.ndarray) -> bool:
    """Each 8-lane phase reads 8 distinct 16-byte bank groups (conflict-free)."""
    g = (addr * 2 // 16) % 8
    return all(len(set(g[8 * i : 8 * i + 8].tolist())) == 8 for i in range(4))


def a_matrix(regs) -> np.ndarray:
    """A fragment (a0..a3, PTX m16n8k16 .row) -> the 16x16 matrix it represents."""
    a = np.full((16, 16), np.nan, np.float32)
    for i, (dr, dk) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        for h in range(2):
            a[GQ + dr, 2 * TQ + h + dk] = regs[i][:, h]
    return a


def b_matrix(r0, r1) -> np.ndarray:
    """B fragment (b0, b1, .col) -> the 16 (k) x 8 (n) matrix."""
    b = np.full((16, 8), np.nan, np.float32)
    for i, dk in enumerate((0, 8)):
        for h in range(2):
            b[2 * TQ + h + dk, GQ] = (r0, r1)[i][:, h]
    return b


def kernel_fragments(hd: int, nk: int, warp: int, q: np.ndarray, k: np.ndarray, v: np.ndarray):
    """What a warp's ldmatrix calls deliver, by the kernel's own lane address formulas. Yields
    ('A'|'K'|'V', step indices, the operand matrix, bank-conflict-free?)."""
    qs, ks, vs = store_tile(q), store_tile(k), store_tile(v)
    lane = LANE
    a_row, a_hi = warp * 16 + (lane & 15), lane >> 4
    b_key, b_hi = (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1
    v_key, v_hi = (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4
    for kk in range(hd // 16):
        addr = swz_off(hd, a_row, 2 * kk + a_hi)
        yield "A", (kk,), a_matrix(ldmatrix_x4(qs, addr, False)), bank_groups_ok(addr)
        for np_ in range(nk // 16):
            addr = swz_off(hd, np_ * 16 + b_key, 2 * kk + b_hi)
            r = ldmatrix_x4(ks, addr, False)
            ok = bank_groups_ok(addr)
            yield "K", (kk, 2 * np_), b_matrix(r[0], r[1]), ok
            yield "K", (kk, 2 * np_ + 1), b_matrix(r[2], r[3]), ok
    for kk in range(nk // 16):
        for dp in range(hd // 16):
            addr = swz_off(hd, kk * 16 + v_key, 2 * dp + v_hi)
            r = ldmatrix_x4(vs, addr, True)
            ok = bank_groups_ok(addr)
            yield "V", (kk, 2 * dp), b_matrix(r[0], r[1]), ok
            yield "V", (kk, 2 * dp + 1), b_matrix(r[2], r[3]), ok


def p_fragment_matrix(s_tiles: np.ndarray, kk: int) -> np.ndarray:
    """The kernel's P A-fragment of k-step kk built from S accumulators (n-tiles 2kk, 2kk+1;
    c0,c1 row gq, c2,c3 row gq+8) -> its 16x16 matrix. s_tiles: [NT][32][4] per-lane accumulators."""
    regs = []
    for h in range(2):
        for i in range(2):
            regs.append(np.stack([s_tiles[2 * kk + h][:, 2 * i], s_tiles[2 * kk + h][:, 2 * i + 1]], axis=1))
    # p[2h + i] -> a-register order a0 = (h0,i0), a1 = (h0,i1), a2 = (h1,i0), a3 = (h1,i1)
    return a_matrix(regs)


def c_fragments(mat: np.ndarray) -> np.ndarray:
    """A 16 x (8 NT) accumulator matrix -> per-lane C fragments [NT][32][4] (c0,c1 row gq; c2,c3 row gq+8)."""
    nt = mat.shape[1] // 8
    out = np.empty((nt, 32, 4), np.float32)
    for n in range(nt):
        out[n, :, 0] = mat[GQ, 8 * n + 2 * TQ]
        out[n, :, 1] = mat[GQ, 8 * n + 2 * TQ + 1]
        out[n, :, 2] = mat[GQ + 8, 8 * n + 2 * TQ]
        out[n, :, 3] = mat[GQ + 8, 8 * n + 2 * TQ + 1]
    return out


# ---------------------------------------------------------------- numerics
def attention_v2(q, kc, vc, gate, pos0: int, nk: int, split_keys: int) -> np.ndarray:
    """The kernel's arithmetic for rows q [n, hd] at positions pos [n] (each row sees keys 0..pos).

    q, gate: [n, hd] fp32 rows (any (lane, head) rows of one kv head); kc, vc [keys, hd] the
    cache values as the kernel stages them (bf16 values). pos0: int array [n] of row positions.
    Returns [n, hd] fp32 = the v2 output with the sigmoid gate.
    """
    pos = np.asarray(pos0)
    n, hd = q.shape
    qb = bf16(q)
    scale_log2 = np.float32(hd ** -0.5 * LOG2E)
    nblk = int(pos.max()) // split_keys + 1
    parts = []
    for b in range(nblk):
        kb0 = b * split_keys
        kend = min(kb0 + split_keys, int(pos.max()) + 1)
        m = np.full(n, -np.inf, np.float32)
        l = np.zeros(n, np.float32)
        o = np.zeros((n, hd), np.float32)
        for k0 in range(kb0, kend, nk):
            keys = np.arange(k0, k0 + nk)
            kt = kc[np.minimum(keys, kc.shape[0] - 1)].astype(np.float32)
            vt = vc[np.minimum(keys, vc.shape[0] - 1)].astype(np.float32)
            past = keys > int(pos.max())
            kt[past], vt[past] = 0.0, 0.0  # zero-filled past the CTA's last row
            s = (qb @ kt.T).astype(np.float32) * scale_log2
            s[keys[None, :] > pos[:, None]] = -np.inf
            mn = np.maximum(m, s.max(axis=1))
            mu = np.where(mn == -np.inf, np.float32(0), mn).astype(np.float32)
            corr = np.exp2(m - mu).astype(np.float32)
            m = mn
            p = bf16(np.exp2(s - mu[:, None]))
            l = (l * corr + p.sum(axis=1, dtype=np.float32)).astype(np.float32)
            o = (o * corr[:, None] + p @ vt).astype(np.float32)
        parts.append((o, m, l))
    sig = 1.0 / (1.0 + np.exp(-gate.astype(np.float32)))
    nb = pos // split_keys + 1
    out = np.empty((n, hd), np.float32)
    one = nb == 1
    o0, m0, l0 = parts[0]
    out[one] = o0[one] / l0[one, None]
    idx = ~one
    if idx.any():
        A, M, Lr = o0[idx].copy(), m0[idx].copy(), l0[idx].copy()
        for b in range(1, nblk):
            ob, mb, lb = parts[b]
            live = nb[idx] > b
            mn = np.where(live, np.maximum(M, mb[idx]), M)
            ca = np.exp2(M - mn)
            cb = np.where(live, np.exp2(np.where(live, mb[idx], 0) - mn), 0)
            A = A * ca[:, None] + np.where(live[:, None], ob[idx], 0) * cb[:, None]
            Lr = Lr * ca + np.where(live, lb[idx], 0) * cb
            M = mn
        out[idx] = A / Lr[:, None]
    return (out * sig).astype(np.float32)


def attention_f64(q, kc, vc, gate, pos) -> np.ndarray:
    """float64 causal softmax attention x sigmoid(gate), per row with its own length."""
    q, kc, vc = (np.asarray(a, np.float64) for a in (q, kc, vc))
    pos = np.asarray(pos)
    hd = q.shape[1]
    s = (q @ kc[: pos.max() + 1].T) * hd ** -0.5
    s[np.arange(pos.max() + 1)[None, :] > pos[:, None]] = -np.inf
    s -= s.max(axis=1, keepdims=True)
    p = np.exp(s)
    out = (p @ vc[: pos.max() + 1]) / p.sum(axis=1, keepdims=True)
    return out / (1.0 + np.exp(-np.asarray(gate, np.float64)))
