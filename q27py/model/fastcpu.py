"""The fast CPU forward pass: the reference model's math, arranged for speed, float32 only.

`FastCPUModel` is a `ReferenceModel` (same state, verify/commit, MTP head, prefix
transfer methods) whose hot blocks are rearranged; reference.py stays the readable
specification and tests/model/test_fastcpu.py holds this path to it.

What changes, and why it is still the same model:
- Batched projections: the projections that read the same input are one matrix
  (GDN q|k|v + z + b + a; attention q+gate | k | v; MLP gate | up), so a layer is
  3-4 matrix products instead of 6-9, and for prefill each is one big GEMM.
- Chunked Gated DeltaNet prefill (the WY / UT form, chunks of 64 tokens): within a
  chunk the delta rule is a unit-lower-triangular system, so the chunk costs a few
  [64 x 64] and [64 x d] matrix products per head instead of 64 Python steps.
  Derivation (per v-head, S0 = state entering the chunk, G_t = cumsum of g in it):
      u_t = b_t (v_t - e^{G_t} S0^T k_t - sum_{s<t} e^{G_t-G_s} (k_t.k_s) u_s)
  i.e. (I + A) U = b*V - (b e^G * K) S0 with A[t,s] = b_t e^{G_t-G_s} k_t.k_s (s < t), so
      U = Uh - W S0,  Uh = (I+A)^-1 (b*V),  W = (I+A)^-1 (b e^G * K)
      O = (e^G * Q) S0 + (QK^T * D) U,   D[t,s] = e^{G_t-G_s} (s <= t)
      S_end = e^{G_n} S0 + (e^{G_n - G} * K)^T U
  Every exponent is <= 0 (g <= 0), so nothing overflows.
- Blocked causal attention for long inputs: query blocks of ATTN_BLOCK rows each see
  only their causal key range; no full T x T score matrix exists at once. GQA shares
  each K/V head across its query heads by reshaping, not by copying K/V.
- Small T (decode, MTP drafts, verify lanes; T <= SMALL_T) is computed row by row with
  the same operations for every row, exactly as the reference does, so a verify of n
  lanes then commit(n) leaves the same bits as n decode steps: speculation stays exact.
"""

from __future__ import annotations

import numpy as np

from q27py.model.checkpoint import Checkpoint
from q27py.model import ops
from q27py.model.config import FULL
from q27py.model.reference import SMALL_T, ReferenceModel
from q27py.model.state import GDNState, KVCache

GDN_CHUNK = 64  # tokens per WY chunk: big enough for GEMMs, small enough that [C x C] stays cheap
ATTN_BLOCK = 128  # query rows per attention block


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x) in three in-place passes; e^-x overflowing to inf gives the right 0."""
    with np.errstate(over="ignore"):
        y = np.exp(-x)
    y += 1.0
    return np.divide(1.0, y, out=y)


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        y = np.exp(-x)
    y += 1.0
    return np.divide(x, y, out=y)


def rms_norm_gated(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * w * silu(z)


def unit_lower_inverse(a: np.ndarray) -> np.ndarray:
    """Inverse of a batch of unit lower triangular matrices [..., n, n], blockwise:
    [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]], down to 16 x 16 blocks solved by
    forward substitution. Batched matmuls only; ~4x faster than np.linalg.inv (general LU) here."""
    n = a.shape[-1]
    x = np.zeros_like(a)
    if n <= 16:
        for i in range(n):
            if i:
                x[..., i, :i] = -np.einsum("...j,...jk->...k", a[..., i, :i], x[..., :i, :i])
            x[..., i, i] = 1.0
        return x
    m = n // 2
    ai, bi = unit_lower_inverse(a[..., :m, :m]), unit_lower_inverse(a[..., m:, m:])
    x[..., :m, :m], x[..., m:, m:] = ai, bi
    x[..., m:, :m] = -(bi @ (a[..., m:, :m] @ ai))
    return x


def gdn_chunked(q, k, v, g, beta, state, chunk: int = GDN_CHUNK):
    """The gated delta rule over T tokens in chunks (same contract as ops.gdn_recurrent without
    per-token states): q, k [T, H, dk], v [T, HV, dv], g, beta [T, HV], state [HV, dk, dv] (not
    modified). Returns (o [T, HV, dv], final state).

    Everything inside a chunk that does not depend on the entering state (decays, the
    triangular inverse, Uh, W, masked QK^T) is computed for all chunks at once; only the
    short state recursion walks the chunks in order.
    """
    t_all, h, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    rep = hv // h
    nc = -(-t_all // chunk)
    pad = nc * chunk - t_all

    def blocks(x):  # [T, heads, d] -> [nc, heads, C, d] contiguous; padded tokens have k = v = beta = g = 0
        if pad:
            x = np.concatenate([x, np.zeros((pad,) + x.shape[1:], dtype=x.dtype)])
        return np.ascontiguousarray(x.reshape(nc, chunk, x.shape[1], -1).transpose(0, 2, 1, 3))

    def per_v_head(x):  # [nc, H, ...] -> [nc, HV, ...]: v-head j reads k-head j // rep
        return np.repeat(x, rep, axis=1) if rep > 1 else x

    qk_h, kk_h = blocks(q), blocks(k)  # [nc, H, C, dk]
    vc = blocks(v)
    gc, bc = blocks(g[:, :, None])[..., 0], blocks(beta[:, :, None])[..., 0]  # [nc, HV, C]
    # A padded token (k = v = beta = g = 0) adds nothing to u, o or the state: it only keeps
    # the shapes whole; its outputs are cut off below.
    # G in float64: under strong decays |G| reaches ~1e3 within a chunk, and an fp32 G_i - G_m
    # would carry ~|G| 2^-24 of absolute error into every e^{G_i - G_m} (1e-5..1e-4 relative: 50x
    # the token-by-token recurrence's error on such heads; tests/model/test_fastcpu.py).
    gam = np.cumsum(gc, axis=-1, dtype=np.float64)
    lower_incl = np.tri(chunk, dtype=bool)
    diff = gam[..., :, None] - gam[..., None, :]
    decay = np.zeros(diff.shape, dtype=gc.dtype)
    np.exp(diff, out=decay, where=lower_incl)  # D[t,s]; 0 above the diagonal (never exponentiated)
    # K K^T and Q K^T are shared by the v-heads of one k-head: computed per k-head, then repeated.
    kt_h = kk_h.transpose(0, 1, 3, 2)
    kc, qc = per_v_head(kk_h), per_v_head(qk_h)
    a = bc[..., :, None] * per_v_head(kk_h @ kt_h)
    a *= decay
    a[..., np.arange(chunk), np.arange(chunk)] = 1.0  # unit diagonal; A itself is strictly lower
    inv = unit_lower_inverse(a)  # unit lower triangular, so always invertible
    eg = np.exp(gam).astype(gc.dtype)
    uh = inv @ (bc[..., None] * vc)  # [nc, HV, C, dv]
    wk = inv @ ((bc * eg)[..., None] * kc)  # [nc, HV, C, dk]
    qk = per_v_head(qk_h @ kt_h)
    qk *= decay
    eq = eg[..., None] * qc
    ktail = (kc * np.exp(gam[..., -1:] - gam).astype(gc.dtype)[..., None]).transpose(0, 1, 3, 2)  # [nc, HV, dk, C]
    # With u = Uh - W S0 substituted, a chunk is affine in its entering state S0:
    #   O     = (e^G Q - (QK^T*D) W) S0 + (QK^T*D) Uh
    #   S_end = (e^{G_n} I - Ktail W) S0 + Ktail Uh
    # so all four factors are batched products over every chunk, and the walk over chunks is
    # one [dk x dk] @ [dk x dv] product each.
    o_state = eq - qk @ wk  # [nc, HV, C, dk]
    o_const = qk @ uh  # [nc, HV, C, dv]
    s_state = ktail @ wk  # [nc, HV, dk, dk], negated and given its e^{G_n} diagonal in place:
    np.negative(s_state, out=s_state)
    s_state[..., np.arange(dk), np.arange(dk)] += np.exp(gam[..., -1:]).astype(gc.dtype)
    s_const = ktail @ uh  # [nc, HV, dk, dv]
    s = state.astype(np.float32, copy=True)
    entering = np.empty((nc, hv, dk, dv), dtype=np.float32)
    for c in range(nc):
        entering[c] = s
        s = s_state[c] @ s + s_const[c]
    out = o_state @ entering + o_const
    out = out.transpose(0, 2, 1, 3).reshape(nc * chunk, hv, dv)[:t_all]
    return out, s


def gdn_steps(q, k, v, g, beta, state, record: bool):
    """The delta rule token by token for small T (decode / verify): the same ops for every
    token, so a verify lane's state is bitwise the state of the equivalent decode step."""
    n_tok, h, _ = q.shape
    hv = v.shape[1]
    rep = hv // h
    qh = np.repeat(q, rep, axis=1)[:, :, None, :]  # [T, HV, 1, dk]
    kh = np.repeat(k, rep, axis=1)
    decay = np.exp(g)
    s = state.copy()
    out = np.empty((n_tok, hv, v.shape[2]), dtype=v.dtype)
    states = np.empty((n_tok,) + s.shape, dtype=s.dtype) if record else None
    for t in range(n_tok):
        s *= decay[t][:, None, None]
        kv_mem = (kh[t][:, None, :] @ s)[:, 0]
        u = beta[t][:, None] * (v[t] - kv_mem)
        s += kh[t][:, :, None] * u[:, None, :]
        out[t] = (qh[t] @ s)[:, 0]
        if record:
            states[t] = s
    return out, s, states


def blocked_attention(q, keys, values, start: int, scale: float, block: int = ATTN_BLOCK):
    """Causal GQA attention of T queries at positions start.. over keys 0..start+T-1, in query
    blocks. q [T, nq, hd]; keys/values [S, nkv, hd]. Returns [T, nq, hd] float32.

    Per KV head, keys[:, h] is a strided [S, hd] matrix BLAS reads in place (no copy, no
    repeat per query head: the head's `rep` query heads are stacked as rows instead). The
    softmax divides the [rows, hd] output rather than the [rows, S] probabilities."""
    t, nq, hd = q.shape
    nkv = keys.shape[1]
    rep = nq // nkv
    out = np.empty((t, nq, hd), dtype=np.float32)
    q = q * np.float32(scale)
    for b0 in range(0, t, block):
        b1 = min(b0 + block, t)
        nb = b1 - b0
        end = start + b1  # keys this block may see
        # Only the block's own diagonal square has future keys to mask (row r = query b0 + r // rep).
        future = np.arange(start + b0, end)[None, :] > np.repeat(np.arange(start + b0, start + b1), rep)[:, None]
        for h in range(nkv):
            qh = q[b0:b1, h * rep : (h + 1) * rep].reshape(nb * rep, hd)
            sc = qh @ keys[:end, h].T  # [nb*rep, end]
            sc[:, start + b0 :][future] = -np.inf
            sc -= sc.max(axis=-1, keepdims=True)
            np.exp(sc, out=sc)
            oh = (sc @ values[:end, h]) / sc.sum(axis=-1, keepdims=True)
            out[b0:b1, h * rep : (h + 1) * rep] = oh.reshape(nb, rep, hd)
    return out


def attend_row(q, keys, values, scale: float):
    """One query row [nq, hd] over `keys`/`values` [n, nkv, hd] (all visible): the small-T
    attention, the same operations for every row whatever T is."""
    nq, hd = q.shape
    nkv = keys.shape[1]
    rep = nq // nkv
    out = np.empty((nq, hd), dtype=np.float32)
    for h in range(nkv):
        sc = keys[:, h] @ (q[h * rep : (h + 1) * rep] * np.float32(scale)).T  # [n, rep]
        sc -= sc.max(axis=0, keepdims=True)
        np.exp(sc, out=sc)
        out[h * rep : (h + 1) * rep] = (sc.T @ values[:, h]) / sc.sum(axis=0)[:, None]
    return out


class FastCPUModel(ReferenceModel):
    state_format = "cpu-fast"  # same layout as the reference, different rounding: keep disk entries apart

    def __init__(self, checkpoint: Checkpoint, dtype: str = "float32"):
        if dtype != "float32":
            raise ValueError("the fast CPU path computes in float32 only (use the reference for float64 / bfloat16)")
        super().__init__(checkpoint, "float32")
        cfg = self.cfg
        w = self.w
        # Fused projections (row blocks of one [out, in] matrix, split after the product).
        for i, kind in enumerate(cfg.layer_types):
            p = f"layers.{i}."
            if kind == FULL:
                self._fuse_attention(p)
            else:
                a = p + "linear_attn."
                names = [a + "in_proj_qkv.weight", a + "in_proj_z.weight", a + "in_proj_b.weight", a + "in_proj_a.weight"]
                self._gdn_split = np.cumsum([w[n].shape[0] for n in names])[:-1]
                w[a + "fused.weight"] = self._fuse(names)
            self._fuse_mlp(p)
        if self.has_mtp:
            self._fuse_attention("mtp.layers.0.")
            self._fuse_mlp("mtp.layers.0.")
        self._lm_head_t = None

    @classmethod
    def load(cls, model_dir, dtype: str = "float32") -> "FastCPUModel":
        return cls(Checkpoint.open(model_dir), dtype)

    def _fuse(self, names: list[str]) -> np.ndarray:
        """One [sum(out), in] matrix from row blocks; the parts are dropped (no second copy in memory)."""
        fused = np.ascontiguousarray(np.concatenate([self.w[n] for n in names]))
        for n in names:
            del self.w[n]
        return fused

    def _fuse_attention(self, p: str) -> None:
        names = [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"]
        self.w[p + "self_attn.qkv.weight"] = self._fuse(names)

    def _fuse_mlp(self, p: str) -> None:
        self.w[p + "mlp.gate_up.weight"] = self._fuse([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])

    # ------------------------------------------------------------------ primitives
    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        w = self.w[name]
        if x.shape[0] <= SMALL_T:
            # One GEMV per row, the same call for every row: row results never depend on T.
            y = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
            for i in range(x.shape[0]):
                y[i] = w @ x[i]
            return y
        return x @ w.T

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return ops.rms_norm(x, self.w[name], self.cfg.rms_norm_eps)

    # ------------------------------------------------------------------ blocks
    def _mlp(self, x: np.ndarray, p: str) -> np.ndarray:
        gu = self._linear(x, p + "mlp.gate_up.weight")
        m = gu.shape[1] // 2
        return self._linear(silu(gu[:, :m]) * gu[:, m:], p + "mlp.down_proj.weight")

    def _attention(self, x: np.ndarray, p: str, kv: KVCache, start: int) -> np.ndarray:
        cfg = self.cfg
        t, nq, nkv, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = self._linear(x, p + "self_attn.qkv.weight")
        nqo, nko = nq * 2 * hd, nkv * hd
        qg = qkv[:, :nqo].reshape(t, nq, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, nq * hd)
        q = ops.rms_norm(q, self.w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
        k = ops.rms_norm(qkv[:, nqo : nqo + nko].reshape(t, nkv, hd), self.w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
        v = qkv[:, nqo + nko :].reshape(t, nkv, hd)
        pos = np.arange(start, start + t)
        cos, sin = ops.rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, np.float32)
        q = ops.apply_rope(q, cos, sin)
        k = ops.apply_rope(k, cos, sin)
        assert kv.length == start, "KV rows must be contiguous with the new tokens"
        kv.append(k, v)
        keys, values = kv.k[: kv.length], kv.v[: kv.length]
        scale = hd ** -0.5
        if t <= SMALL_T:
            o = np.stack([attend_row(q[i], keys[: start + i + 1], values[: start + i + 1], scale) for i in range(t)])
        else:
            o = blocked_attention(q, keys, values, start, scale)
        o = o.reshape(t, nq * hd).astype(np.float32) * sigmoid(gate)
        return self._linear(o, p + "self_attn.o_proj.weight")

    def _gdn(self, x: np.ndarray, p: str, st: GDNState, record: bool):
        cfg = self.cfg
        a = p + "linear_attn."
        t = x.shape[0]
        h, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        raw, z, b, ga = np.split(self._linear(x, a + "fused.weight"), self._gdn_split, axis=1)
        conv_out, new_conv = ops.causal_conv1d(raw, self.w[a + "conv1d.weight"], st.conv)
        mixed = silu(conv_out)
        kd = cfg.gdn_key_dim
        q = ops.l2norm(mixed[:, :kd].reshape(t, h, dk)) * np.float32(dk ** -0.5)
        k = ops.l2norm(mixed[:, kd : 2 * kd].reshape(t, h, dk))
        v = mixed[:, 2 * kd :].reshape(t, hv, dv)
        beta = sigmoid(b)
        g = self.w[a + "neg_A"] * ops.softplus(ga + self.w[a + "dt_bias"])
        if record or t <= SMALL_T:
            o, final, states = gdn_steps(q, k, v, g, beta, st.recurrent, record)
        else:
            o, final = gdn_chunked(q, k, v, g, beta, st.recurrent)
        o = rms_norm_gated(o, z.reshape(t, hv, dv), self.w[a + "norm.weight"], cfg.rms_norm_eps)
        out = self._linear(o.reshape(t, hv * dv), a + "out_proj.weight")
        if record:
            km1 = cfg.linear_conv_kernel_dim - 1
            history = np.concatenate([st.conv, raw], axis=0)
            windows = np.stack([history[i + 1 : i + 1 + km1] for i in range(t)])
            return out, (states, windows)
        return out, (final, new_conv)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        if hidden.shape[0] == 0:
            return np.zeros((0, self.lm_head.shape[0]), dtype=np.float32)
        if hidden.shape[0] <= SMALL_T:
            y = np.empty((hidden.shape[0], self.lm_head.shape[0]), dtype=np.float32)
            for i in range(hidden.shape[0]):
                y[i] = self.lm_head @ hidden[i]
            return y
        return hidden @ self.lm_head.T
