"""Context auto-sizing and the automatic KV format: pure Python, no device calls.

The fast path measures free device memory after the weights are resident and asks
`context_window` how many positions fit:

    window = (free - graphs - scratch - safety margin - sequences * fixed state)
             / (sequences * KV bytes per token)

rounded down to WINDOW_ALIGN and capped at the model's max_position_embeddings. `sequences`
is how many sequences the engine may hold at once (EngineConfig.live_sequences(): max_sequences,
at least max_slots): every live sequence owns a full window of KV rows, so the budget is split
between them. The safety margin
(EngineConfig.kv_safety_margin_bytes) is what CUDA graph instantiation and the allocator's slack
need on top of the measured scratch; its default is to be confirmed on the device (docs/KV.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from q27py.model.kvformat import FORMATS, bytes_per_token

WINDOW_ALIGN = 1024  # positions: windows are whole prefill chunks
GIB = 1 << 30


@dataclass(frozen=True)
class ContextBudget:
    window: int  # positions per sequence
    kv_format: str
    bytes_per_token: int  # KV bytes of one position (all attention layers + MTP)
    sequences: int
    free_bytes: int  # measured free memory after weights
    reserved_bytes: int  # graphs + scratch + margin + fixed per-sequence state
    limited_by: str  # "memory" or "model" (max_position_embeddings)

    def describe(self) -> str:
        kv_gib = self.window * self.bytes_per_token * self.sequences / GIB
        return (f"context window {self.window:,} tokens x {self.sequences} sequence(s), KV {self.kv_format} "
                f"({self.bytes_per_token:,} B/token, {kv_gib:.2f} GiB), limited by {self.limited_by}; "
                f"free after weights {self.free_bytes / GIB:.2f} GiB, reserved {self.reserved_bytes / GIB:.2f} GiB")


def context_window(free_bytes: int, kv_bytes_per_token: int, *, kv_format: str = "?", sequences: int = 1,
                   fixed_per_sequence: int = 0, scratch_bytes: int = 0, graph_bytes: int = 0,
                   margin_bytes: int = 0, max_positions: int | None = None,
                   align: int = WINDOW_ALIGN) -> ContextBudget:
    """The largest window whose KV cache fits what is left; raises ValueError when not even `align` fits."""
    if kv_bytes_per_token <= 0 or sequences < 1:
        raise ValueError("bytes per token and sequences must be positive")
    reserved = int(graph_bytes + scratch_bytes + margin_bytes + sequences * fixed_per_sequence)
    left = int(free_bytes) - reserved
    window = max(left, 0) // (sequences * kv_bytes_per_token)
    window -= window % align
    limited = "memory"
    if max_positions is not None and window >= max_positions:
        window, limited = int(max_positions), "model"
    if window < min(align, max_positions or align):
        raise ValueError(
            f"no room for a KV cache: {free_bytes / GIB:.2f} GiB free after weights, {reserved / GIB:.2f} GiB reserved "
            f"(graphs, scratch, margin, {sequences} sequence state(s)), {kv_bytes_per_token:,} B/token x {sequences}")
    return ContextBudget(window, kv_format, kv_bytes_per_token, sequences, int(free_bytes), reserved, limited)


def auto_kv_format(compute_capability: tuple[int, int], implemented: tuple[str, ...] = FORMATS) -> str:
    """The KV format `--kv auto` picks on a GPU of this compute capability.

    sm_89+ (Ada, Hopper, Blackwell) converts e4m3 in hardware: fp8, half of bf16's bytes at the
    smallest quality cost of the lossy formats (docs/KV.md). sm_80/86 have no fp8 conversion; there
    the rotated 5-bit-K / 3-bit-V format holds 3.9x bf16's window with fewer catastrophic positions
    than 3-bit K. `implemented` is what the fast path's kernels read today: a choice it lacks falls
    back to the next best format it has (bf16 last).
    """
    major, minor = compute_capability
    prefs = ("fp8", "k5v3", "bf16") if (major, minor) >= (8, 9) else ("k5v3", "fp8", "bf16")
    for f in prefs:
        if f in implemented:
            return f
    return "bf16"


def card_capacity(card_bytes: int, weight_bytes: int, fmt: str, n_kv_layers: int, n_kv_heads: int, head_dim: int,
                  *, overhead_bytes: int, sequences: int = 1, fixed_per_sequence: int = 0,
                  max_positions: int | None = None) -> int:
    """Tokens of one format's window on a card of card_bytes (docs table): the budget with the
    card's memory minus the weights standing in for the measured free memory."""
    b = context_window(card_bytes - weight_bytes, bytes_per_token(fmt, n_kv_layers, n_kv_heads, head_dim),
                       kv_format=fmt, sequences=sequences, fixed_per_sequence=fixed_per_sequence,
                       margin_bytes=overhead_bytes, max_positions=max_positions)
    return b.window
