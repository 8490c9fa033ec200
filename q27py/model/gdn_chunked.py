"""The gated delta rule in chunked (WY / UT) form: the specification of cuda/gdn_chunk.cu.

ops.gdn_recurrent (token by token) is the definition; this is the same map reorganised so that
a chunk of C tokens costs a few C x C and C x d matrix products per value head (tensor-core
work on the GPU) plus one short triangular solve, and only the state crosses chunks.

Derivation, per value head, S in R^{dk x dv}, S0 the state entering the chunk, tokens i = 0..n-1
of the chunk, G_i = sum_{m<=i} g_m (log-space cumulative decay, so every ratio below is an
exp of a difference <= 0: no overflow, and strong decays underflow to 0 harmlessly):
    S_i = e^{g_i} S_{i-1} + k_i u_i^T,   u_i = b_i (v_i - e^{g_i} S_{i-1}^T k_i)
Unrolling S_{i-1} = e^{G_{i-1}} S0 + sum_{m<i} e^{G_{i-1} - G_m} k_m u_m^T gives
    u_i = b_i (v_i - e^{G_i} S0^T k_i - sum_{m<i} e^{G_i - G_m} (k_i . k_m) u_m)
i.e. the unit lower triangular system (I + A) U = R with
    A_im = b_i e^{G_i - G_m} (k_i . k_m)   (m < i),   R = diag(b) (V - diag(e^G) K S0)
and then, with M_im = e^{G_i - G_m} (m <= i, else 0),
    O   = diag(e^G) Q S0 + (M o (Q K^T)) U
    S_n = e^{G_{n-1}} S0 + K^T diag(e^{G_{n-1} - G}) U
(the brief's W = T diag(b e^G) K and U~ = T diag(b) V are the same U = T R split in two; the
kernel never forms W: it solves for U blockwise, U_b = T_b (R_b - A_{b,<b} U_{<b}) with T_b the
inverses of A's 16 x 16 diagonal blocks, all on tensor cores.)
Helper `default` (branch default, q27py/model/fastcpu.py) derived the same form for the CPU fast
path; this module keeps the GPU kernel's order of operations and its chunk alignment.

Chunk alignment: chunks start at absolute positions that are multiples of C (pos0 is the position
of the first token), so the same token always lands in the same chunk however the prompt was
split into prefill pieces or restored from a snapshot at a multiple of C; see chunk_spans.
"""

from __future__ import annotations

import numpy as np

CHUNK = 64  # tokens per chunk on the GPU (cuda/gdn_chunk.cu); 32 where shared memory is small


def chunk_spans(pos0: int, t: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """(start, length) of each chunk of t tokens whose first sits at absolute position pos0:
    boundaries at multiples of `chunk`, so the first (and last) chunk may be partial."""
    spans, s = [], 0
    while s < t:
        n = min(chunk - (pos0 + s) % chunk, t - s)
        spans.append((s, n))
        s += n
    return spans


def gdn_chunked(q, k, v, g, beta, state, chunk: int = CHUNK, pos0: int = 0):
    """Same contract as ops.gdn_recurrent (without per-token states): q, k [T, H, dk] (already
    normalised / scaled), v [T, HV, dv], g (log decay <= 0), beta [T, HV], state [HV, dk, dv]
    (not modified). Returns (o [T, HV, dv], final state [HV, dk, dv]) in the inputs' dtype."""
    t_all, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    rep = hv // h
    dt = np.result_type(q.dtype, v.dtype, state.dtype)
    qh = np.repeat(q, rep, axis=1).astype(dt).transpose(1, 0, 2)  # [HV, T, dk]
    kh = np.repeat(k, rep, axis=1).astype(dt).transpose(1, 0, 2)
    vh = v.astype(dt).transpose(1, 0, 2)  # [HV, T, dv]
    gh, bh = g.astype(dt).T, beta.astype(dt).T  # [HV, T]
    s = state.astype(dt, copy=True)
    out = np.empty((hv, t_all, dv), dtype=dt)
    for c0, n in chunk_spans(pos0, t_all, chunk):
        sl = slice(c0, c0 + n)
        qc, kc, vc, b = qh[:, sl], kh[:, sl], vh[:, sl], bh[:, sl]
        gam = np.cumsum(gh[:, sl], axis=1)  # [HV, n]
        diff = gam[:, :, None] - gam[:, None, :]  # G_i - G_m
        low = np.tri(n, dtype=bool)  # m <= i
        decay = np.exp(np.where(low, diff, -np.inf)).astype(dt)  # M; 0 above the diagonal
        kk = kc @ kc.transpose(0, 2, 1)
        a = b[:, :, None] * kk * decay
        a[:, np.arange(n), np.arange(n)] = 0.0  # strictly lower
        eg = np.exp(gam)
        r = b[:, :, None] * (vc - eg[:, :, None] * (kc @ s))  # [HV, n, dv]
        u = np.empty_like(r)
        for i in range(n):  # forward substitution of (I + A) U = R, row by row
            u[:, i] = r[:, i] - np.einsum("hm,hmv->hv", a[:, i, :i], u[:, :i])
        qk = (qc @ kc.transpose(0, 2, 1)) * decay
        out[:, sl] = eg[:, :, None] * (qc @ s) + qk @ u
        tail = np.exp(gam[:, -1:] - gam)  # e^{G_{n-1} - G_i}
        s = np.exp(gam[:, -1])[:, None, None] * s + (kc * tail[:, :, None]).transpose(0, 2, 1) @ u
    return out.transpose(1, 0, 2), s


def gdn_chunked_wy(q, k, v, g, beta, state, chunk: int = CHUNK, pos0: int = 0, tf32=()):
    """The same map in the three-phase order of cuda/gdn_chunk2.cu (route "chunked2"); same contract
    as gdn_chunked. With T = (I + A)^-1 (A as above):
      phase 1, every chunk independently: W = T diag(b e^G) K,  U = T diag(b) V
      phase 2, chunk after chunk:          V_new = U - W S_c,  S_{c+1} = e^{G_last} S_c + K^T diag(e^{G_last - G}) V_new
      phase 3, every chunk independently: O = diag(e^G) Q S_c + (M o Q K^T) V_new
    (U - W S_c = T diag(b) (V - diag(e^G) K S_c) is the U of gdn_chunked: the split moves every
    state-independent product out of the sequential loop.)
    G is summed in float64 whatever the inputs' dtype, as the kernels do (a double scan kept as
    hi + lo floats): in fp32, |G| ~ 1e3 under strong decays leaves ~1e-4 of absolute error in
    G_i - G_m, i.e. ~1e-5..1e-4 relative on every decay factor -- so a float32 run of this
    function is the kernels' error class, not that of a worse cumulative sum.

    tf32: the phases ("prep", "state", "out") whose matrix products take their operands rounded to
    TF32 (round to nearest, ties away: cuda/gdn_chunk2.cu to_tf32) with fp32 accumulation -- the
    kernels' one-product-a-mma classes (gdn2_out1_* "tf32 out", gdn2_prep1_* / gdn2_state1_* "tf32
    state"; docs/QUANT.md). Float32 inputs only. With "prep" the solve runs blockwise as the kernel
    does (16 x 16 diagonal inverses by fp32 substitution, then tensor-core block products):
    Y_b = T_b (X_b - A_{b,<b} Y_{<b}). The error class, not the kernels' bits (their sums run in mma
    order)."""
    t_all, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    rep = hv // h
    dt = np.result_type(q.dtype, v.dtype, state.dtype)
    tf32 = frozenset(tf32)
    if not tf32 <= {"prep", "state", "out"}:
        raise ValueError(f"tf32 phases: prep, state, out (got {sorted(tf32)})")
    if tf32 and dt != np.float32:
        raise ValueError("tf32 products are a float32 class")
    rp, rs, ro = (round_tf32 if ph in tf32 else _same for ph in ("prep", "state", "out"))
    qh = np.repeat(q, rep, axis=1).astype(dt).transpose(1, 0, 2)
    kh = np.repeat(k, rep, axis=1).astype(dt).transpose(1, 0, 2)
    vh = v.astype(dt).transpose(1, 0, 2)
    gh, bh = g.astype(dt).T, beta.astype(dt).T
    spans = chunk_spans(pos0, t_all, chunk)
    pre = []  # phase 1
    for c0, n in spans:
        sl = slice(c0, c0 + n)
        kc, b = kh[:, sl], bh[:, sl]
        gam = np.cumsum(gh[:, sl], axis=1, dtype=np.float64)
        low = np.tri(n, dtype=bool)
        decay = np.exp(np.where(low, gam[:, :, None] - gam[:, None, :], -np.inf)).astype(dt)
        a = b[:, :, None] * (rp(kc) @ rp(kc).transpose(0, 2, 1)) * decay
        a[:, np.arange(n), np.arange(n)] = 0.0
        rhs = np.concatenate([(b * np.exp(gam).astype(dt))[:, :, None] * kc, b[:, :, None] * vh[:, sl]], axis=2)
        y = _solve_blocks(a, rhs) if "prep" in tf32 else _solve_rows(a, rhs)
        pre.append((gam, decay, y[:, :, :dk], y[:, :, dk:]))
    s = state.astype(dt, copy=True)
    starts, vnew = [], []  # phase 2
    for (c0, n), (gam, _, w, u) in zip(spans, pre):
        starts.append(s)
        vn = u - rs(w) @ rs(s)
        vnew.append(vn)
        ed = np.exp(gam[:, -1:] - gam).astype(dt)
        s = np.exp(gam[:, -1]).astype(dt)[:, None, None] * s + (
            rs(kh[:, c0 : c0 + n]).transpose(0, 2, 1) @ rs(ed[:, :, None] * vn))
    out = np.empty((hv, t_all, dv), dtype=dt)  # phase 3
    for (c0, n), (gam, decay, _, _), s0, vn in zip(spans, pre, starts, vnew):
        qc, kc = qh[:, c0 : c0 + n], kh[:, c0 : c0 + n]
        m = (ro(qc) @ ro(kc).transpose(0, 2, 1)) * decay
        out[:, c0 : c0 + n] = np.exp(gam).astype(dt)[:, :, None] * (ro(qc) @ ro(s0)) + ro(m) @ ro(vn)
    return out.transpose(1, 0, 2), s


def round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 (10 mantissa bits), nearest with ties away from zero: the
    kernels' to_tf32 ((bits + 0x1000) & 0xffffe000 on finite values)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return ((x.view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def _same(x):
    return x


def _solve_rows(a: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """(I + A) Y = RHS by forward substitution, row by row (A strictly lower, [HV, n, n])."""
    y = np.empty_like(rhs)
    for i in range(a.shape[1]):
        y[:, i] = rhs[:, i] - np.einsum("hm,hmv->hv", a[:, i, :i], y[:, :i])
    return y


def _solve_blocks(a: np.ndarray, rhs: np.ndarray, blk: int = 16) -> np.ndarray:
    """(I + A) Y = RHS as gdn2_prep1_* solves it: T_b = (I + A_bb)^-1 by fp32 substitution, then
    Y_b = T_b (X_b - A_{b,<b} Y_{<b}) with both block products on TF32 operands."""
    hv, n, _ = a.shape
    y = np.empty_like(rhs)
    for b0 in range(0, n, blk):
        b1 = min(b0 + blk, n)
        nb = b1 - b0
        t = np.empty((hv, nb, nb), dtype=a.dtype)  # columns of the inverse, one substitution each
        eye = np.eye(nb, dtype=a.dtype)
        for j in range(nb):
            col = np.empty((hv, nb), dtype=a.dtype)
            for i in range(nb):
                col[:, i] = eye[i, j] - np.einsum("hm,hm->h", a[:, b0 + i, b0 : b0 + i], col[:, :i])
            t[:, :, j] = col
        x = rhs[:, b0:b1]
        if b0:
            x = x - round_tf32(a[:, b0:b1, :b0]) @ round_tf32(y[:, :b0])
        y[:, b0:b1] = round_tf32(t) @ round_tf32(x)
    return y
