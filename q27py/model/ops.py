"""The numpy reference operators: the specification every CUDA kernel is tested against.

Each function computes in the dtype of its inputs (fp32 normally, fp64 for the
high-precision reference), exactly as transformers' Qwen3.5 modeling code does.
Shapes use T for tokens; weights are [out, in] as stored in the checkpoint.
"""

from __future__ import annotations

import numpy as np


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x @ w.T for a weight stored [out, in]."""
    return x @ w.T


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    # Split by sign so exp never overflows.
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    e = np.exp(x[~pos])
    out[~pos] = e / (1.0 + e)
    return out


def softplus(x: np.ndarray) -> np.ndarray:
    # torch.nn.functional.softplus (beta=1, threshold=20): linear above 20.
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm used by every norm except the GDN output norm: x̂ · (1 + w)."""
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * (1.0 + w)


def rms_norm_gated(x: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The GDN output norm: plain weight (no +1), norm before gate: x̂ · w · silu(z)."""
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * w * silu(z)


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """x · rsqrt(Σx² + eps) over the last axis (fla's use_qk_l2norm_in_kernel)."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def swiglu_mlp(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    return linear(silu(linear(x, w_gate)) * linear(x, w_up), w_down)


def causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv over time, no bias, no activation.

    x: [T, C] new inputs; weight: [C, K]; state: [K-1, C] the previous K-1 raw inputs
    (zeros at sequence start). y[t, c] = Σ_j weight[c, j] · xx[t + j, c] where
    xx = concat(state, x). Returns (y [T, C], new_state [K-1, C]).
    """
    k = weight.shape[1]
    xx = np.concatenate([state, x], axis=0)
    t = x.shape[0]
    y = np.zeros_like(x)
    for j in range(k):
        y += xx[j : j + t] * weight[:, j]
    return y, xx[xx.shape[0] - (k - 1) :].copy()


def gdn_recurrent(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
    return_all_states: bool = False,
):
    """The gated delta rule, token by token (the recurrent form).

    q, k: [T, H, dk] already l2-normalised (q also scaled by dk^-0.5); v: [T, HV, dv];
    g: [T, HV] log-decay (<= 0); beta: [T, HV]; state: [HV, dk, dv] (not modified).
    v-head j reads k-head j // (HV // H). Per v-head and token:
        S = e^g S;  u = β (v − Sᵀk);  S = S + k uᵀ;  o = Sᵀ q
    Returns (o [T, HV, dv], final state) or, with return_all_states, also the
    state after every token [T, HV, dk, dv] (what speculative verify lanes need).
    """
    n_tok, h, _ = q.shape
    hv = v.shape[1]
    rep = hv // h
    qh = np.repeat(q, rep, axis=1)  # [T, HV, dk]
    kh = np.repeat(k, rep, axis=1)
    s = state.copy()
    out = np.empty((n_tok, hv, v.shape[2]), dtype=v.dtype)
    all_states = np.empty((n_tok,) + s.shape, dtype=s.dtype) if return_all_states else None
    for t in range(n_tok):
        s *= np.exp(g[t])[:, None, None]
        kv_mem = np.einsum("hk,hkv->hv", kh[t], s)
        u = beta[t][:, None] * (v[t] - kv_mem)
        s += kh[t][:, :, None] * u[:, None, :]
        out[t] = np.einsum("hk,hkv->hv", qh[t], s)
        if all_states is not None:
            all_states[t] = s
    if return_all_states:
        return out, s, all_states
    return out, s


def rope_cos_sin(positions: np.ndarray, rotary_dim: int, theta: float, dtype=np.float32):
    """cos/sin tables [T, rotary_dim] for rotate-half (NeoX) RoPE.

    Text-only M-RoPE has equal T/H/W positions, which makes it exactly this 1-D RoPE.
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    freqs = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    # transformers computes the table in fp32 (then casts); match that rounding.
    emb32 = emb.astype(np.float32)
    return np.cos(emb32).astype(dtype), np.sin(emb32).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Partial rotate-half RoPE: x [T, n_heads, hd]; the first cos.shape[-1] dims rotate, the rest pass."""
    rd = cos.shape[-1]
    half = rd // 2
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., :half], xr[..., half:]
    rotated = np.concatenate([-x2, x1], axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([xr * c + rotated * s, xp], axis=-1)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, scale: float) -> np.ndarray:
    """Causal GQA softmax attention over a KV cache.

    q: [T, nq, hd] at absolute positions q_pos [T]; k, v: [S, nkv, hd] holding
    positions 0..S-1. Query at position p sees keys 0..p. Query head i uses kv head
    i // (nq // nkv). Returns [T, nq, hd].
    """
    nq, nkv = q.shape[1], k.shape[1]
    rep = nq // nkv
    kh = np.repeat(k, rep, axis=1)  # [S, nq, hd]
    vh = np.repeat(v, rep, axis=1)
    scores = np.einsum("tnd,snd->nts", q, kh) * scale
    key_pos = np.arange(k.shape[0])
    mask = key_pos[None, :] > np.asarray(q_pos)[:, None]  # [T, S]
    scores = np.where(mask[None], -np.inf, scores)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("nts,snd->tnd", p, vh)
