"""Per-sequence model state on the reference path: what a sequence carries between forwards.

- Attention layers (and the MTP layer) keep K/V rows, one per position, append-only.
- Gated DeltaNet layers keep the recurrent state S [HV, dk, dv] (always fp32 or wider:
  it is a running summary, bf16 would drift) and the conv window, the last K-1 raw
  conv inputs [K-1, C].

A GDN state can only be resumed from a position where it was saved; attention KV
rows can be cut back to any length. `snapshot()` / `restore()` copy exactly what
prefix reuse and speculative rollback need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from q27py.model.config import ModelConfig


class KVCache:
    """K/V rows of one attention layer, grown geometrically; rows [0, length) are valid."""

    def __init__(self, n_kv_heads: int, head_dim: int, dtype, capacity: int = 64):
        self.k = np.zeros((capacity, n_kv_heads, head_dim), dtype=dtype)
        self.v = np.zeros((capacity, n_kv_heads, head_dim), dtype=dtype)
        self.length = 0

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        n = k.shape[0]
        need = self.length + n
        if need > self.k.shape[0]:
            cap = max(need, 2 * self.k.shape[0])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = np.zeros((cap,) + old.shape[1:], dtype=old.dtype)
                new[: self.length] = old[: self.length]
                setattr(self, name, new)
        self.k[self.length : need] = k
        self.v[self.length : need] = v
        self.length = need

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length

    def copy(self) -> "KVCache":
        c = KVCache.__new__(KVCache)
        c.k, c.v, c.length = self.k[: self.length].copy(), self.v[: self.length].copy(), self.length
        return c


@dataclass
class GDNState:
    recurrent: np.ndarray  # [HV, dk, dv]
    conv: np.ndarray  # [K-1, C] previous raw conv inputs

    def copy(self) -> "GDNState":
        return GDNState(self.recurrent.copy(), self.conv.copy())


@dataclass
class SequenceState:
    """Everything one sequence needs to continue: position, KV rows, GDN + conv state, MTP KV."""

    position: int  # tokens committed so far (= KV rows of every attention layer)
    kv: dict[int, KVCache]
    gdn: dict[int, GDNState]
    mtp_kv: KVCache | None
    # The MTP layer's row for position p needs token p+1, so it is written one step late;
    # mtp_kv.length <= position, and the engine tops it up when the next token is known.
    extra: dict = field(default_factory=dict)

    @classmethod
    def new(cls, cfg: ModelConfig, dtype=np.float32, state_dtype=np.float32, with_mtp: bool = True) -> "SequenceState":
        kv = {i: KVCache(cfg.num_key_value_heads, cfg.head_dim, dtype) for i in cfg.full_layers}
        gdn = {
            i: GDNState(
                np.zeros((cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), dtype=state_dtype),
                np.zeros((cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim), dtype=dtype),
            )
            for i in cfg.linear_layers
        }
        mtp = KVCache(cfg.num_key_value_heads, cfg.head_dim, dtype) if with_mtp else None
        return cls(0, kv, gdn, mtp)

    def snapshot(self) -> "SequenceState":
        """A deep copy (KV rows included)."""
        return SequenceState(
            self.position,
            {i: c.copy() for i, c in self.kv.items()},
            {i: g.copy() for i, g in self.gdn.items()},
            self.mtp_kv.copy() if self.mtp_kv is not None else None,
            dict(self.extra),
        )

    def restore(self, other: "SequenceState") -> None:
        """Become a copy of `other` (used to rewind to a snapshot)."""
        snap = other.snapshot()
        self.position, self.kv, self.gdn, self.mtp_kv, self.extra = (
            snap.position, snap.kv, snap.gdn, snap.mtp_kv, snap.extra,
        )
