"""Per-sequence model state on the reference path: what a sequence carries between forwards.

- Attention layers (and the MTP layer) keep K/V rows, one per position, append-only, in the
  compute dtype or, with a KV format, quantized on store (QuantKVCache).
- Gated DeltaNet layers keep the recurrent state S [HV, dk, dv] (always fp32 or wider:
  it is a running summary, bf16 would drift) and the conv window, the last K-1 raw
  conv inputs [K-1, C].

A GDN state can only be resumed from a position where it was saved; attention KV
rows can be cut back to any length. `snapshot()` / `restore()` copy exactly what
prefix reuse and speculative rollback need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from q27py.model.config import ModelConfig
from q27py.model.kvformat import KVFormat, get_format


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

    # What a prefix snapshot stores: the rows as held (names -> arrays with the row axis first).
    def export_rows(self, n: int) -> dict[str, np.ndarray]:
        return {"k": self.k[:n].copy(), "v": self.v[:n].copy()}

    def import_rows(self, arrays: dict[str, np.ndarray]) -> None:
        self.truncate(0)
        self.append(arrays["k"], arrays["v"])


class QuantKVCache(KVCache):
    """K/V rows stored in a KV format (q27py/model/kvformat.py): quantized on store.

    `payload` holds the stored bytes; `k` / `v` hold their dequantization in the model dtype.
    Dequantization is a pure function of the bytes, so keeping it beside them is the same as
    dequantizing on every read (what a kernel does) and saves the reference a decode per step.
    Snapshots export the payload, never the dequantized rows: re-quantizing those need not give
    the same bytes, and a restore must be bitwise the state that was saved.
    """

    def __init__(self, n_kv_heads: int, head_dim: int, dtype, fmt: KVFormat | str, capacity: int = 64):
        super().__init__(n_kv_heads, head_dim, dtype, capacity)
        self.fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        self.head_dim = head_dim
        self.payload: dict[str, np.ndarray] = {}  # "k.codes", "k.exp", "v.norm", ... [capacity, heads, ...]

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        parts = {f"k.{n}": a for n, a in self.fmt.quantize(np.asarray(k, np.float32), "k").items()}
        parts.update({f"v.{n}": a for n, a in self.fmt.quantize(np.asarray(v, np.float32), "v").items()})
        self._append_payload(parts)

    def _append_payload(self, parts: dict[str, np.ndarray]) -> None:
        n = next(iter(parts.values())).shape[0]
        start, need = self.length, self.length + n
        for name, a in parts.items():
            old = self.payload.get(name)
            if old is None or old.shape[0] < need:
                cap = max(need, 2 * (old.shape[0] if old is not None else 0), 64)
                new = np.zeros((cap,) + a.shape[1:], dtype=a.dtype)
                if old is not None:
                    new[:start] = old[:start]
                self.payload[name] = new
            self.payload[name][start:need] = a
        k = self._dequant("k", start, need)
        v = self._dequant("v", start, need)
        super().append(k.astype(self.k.dtype), v.astype(self.v.dtype))

    def _dequant(self, which: str, lo: int, hi: int) -> np.ndarray:
        part = {name.split(".", 1)[1]: a[lo:hi] for name, a in self.payload.items() if name.startswith(which + ".")}
        return self.fmt.dequantize(part, which, self.head_dim)

    def copy(self) -> "QuantKVCache":
        c = QuantKVCache.__new__(QuantKVCache)
        c.k, c.v, c.length = self.k[: self.length].copy(), self.v[: self.length].copy(), self.length
        c.fmt, c.head_dim = self.fmt, self.head_dim
        c.payload = {name: a[: self.length].copy() for name, a in self.payload.items()}
        return c

    def export_rows(self, n: int) -> dict[str, np.ndarray]:
        return {name: a[:n].copy() for name, a in self.payload.items()}

    def import_rows(self, arrays: dict[str, np.ndarray]) -> None:
        expect = set(self.payload) or {f"{w}.{n}" for w in "kv" for n in self.fmt.quantize(np.zeros((1, 1, self.head_dim), np.float32), w)}
        if set(arrays) != expect:
            raise ValueError(f"KV rows in another format: {sorted(arrays)} vs {sorted(expect)} ({self.fmt.name})")
        self.truncate(0)
        self._append_payload(arrays)


def make_kv_cache(n_kv_heads: int, head_dim: int, dtype, kv_format: str | None) -> KVCache:
    """None keeps rows in the compute dtype (the reference's default); a format name quantizes on store."""
    if kv_format is None:
        return KVCache(n_kv_heads, head_dim, dtype)
    return QuantKVCache(n_kv_heads, head_dim, dtype, kv_format)


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
    # What the engine keeps with a sequence (the fast path's FastState has the same two fields):
    # the post-norm hidden row at position - 1 (host, [1, H]): the MTP head needs it to resume;
    hidden_last: np.ndarray | None = None
    # the speculative decoder's suffix index of the sequence's last stream (engine/drafters.py
    # SuffixIndex), reused when the next prompt extends it.
    suffix_index: Any = None

    @classmethod
    def new(cls, cfg: ModelConfig, dtype=np.float32, state_dtype=np.float32, with_mtp: bool = True,
            kv_format: str | None = None) -> "SequenceState":
        kv = {i: make_kv_cache(cfg.num_key_value_heads, cfg.head_dim, dtype, kv_format) for i in cfg.full_layers}
        gdn = {
            i: GDNState(
                np.zeros((cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), dtype=state_dtype),
                np.zeros((cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim), dtype=dtype),
            )
            for i in cfg.linear_layers
        }
        mtp = make_kv_cache(cfg.num_key_value_heads, cfg.head_dim, dtype, kv_format) if with_mtp else None
        return cls(0, kv, gdn, mtp)

    def snapshot(self) -> "SequenceState":
        """A deep copy (KV rows included)."""
        return SequenceState(
            self.position,
            {i: c.copy() for i, c in self.kv.items()},
            {i: g.copy() for i, g in self.gdn.items()},
            self.mtp_kv.copy() if self.mtp_kv is not None else None,
            None if self.hidden_last is None else self.hidden_last.copy(),
            self.suffix_index,
        )

    def restore(self, other: "SequenceState") -> None:
        """Become a copy of `other` (used to rewind to a snapshot)."""
        snap = other.snapshot()
        self.position, self.kv, self.gdn, self.mtp_kv, self.hidden_last, self.suffix_index = (
            snap.position, snap.kv, snap.gdn, snap.mtp_kv, snap.hidden_last, snap.suffix_index,
        )
