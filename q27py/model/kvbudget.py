"""Context auto-sizing and the automatic KV format: pure Python, no device calls.

The fast path measures free device memory after the weights are resident and asks
`context_window` how many positions fit:

    window = (free - graphs - scratch - safety margin - sequences * fixed state)
             / (sequences * KV bytes per token)

rounded down to WINDOW_ALIGN and capped at the model's max_position_embeddings. `sequences`
is how many sequences the engine may hold at once (EngineConfig.live_sequences(): max_sequences,
at least max_slots): every live sequence owns a full window of KV rows, so the budget is split
between them. Each state's fixed part is its GDN + conv state plus the CUDA graphs captured for
it (EngineConfig.graph_bytes_per_layer x layers). The safety margin (EngineConfig.kv_safety_margin_bytes)
is what the allocator's slack and the CUDA context need on top of the measured scratch; its
default is to be confirmed on the device (docs/KV.md).

`plan_slots` decides `--max-slots auto` and `--max-context auto` together: every slot owns one
of those states, so the slot count and the window share one budget (its docstring has the rules).
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


@dataclass(frozen=True)
class SlotPlan:
    """`--max-slots` and `--max-context` decided together (plan_slots)."""

    slots: int  # requests generating at once
    budget: ContextBudget  # the window and the live sequences it is sized for (>= slots)
    state_bytes: int  # one sequence state at the window: KV rows + GDN/conv state + its graphs
    fit: int  # states of state_bytes the free memory holds after the margin
    limited_by: str  # what set the slot count: "cap" | "memory" | "flag"

    def describe(self) -> str:
        return (f"{self.slots} slot(s) (limited by {self.limited_by}; {self.fit} state(s) of "
                f"{self.state_bytes / GIB:.2f} GiB fit); {self.budget.describe()}")


def states_fit(free_bytes: int, window: int, kv_bytes_per_token: int, *, fixed_per_sequence: int = 0,
               graph_bytes_per_state: int = 0, scratch_bytes: int = 0, margin_bytes: int = 0) -> int:
    """Sequence states of `window` positions (KV rows, fixed GDN state, the state's graphs) that fit."""
    per = window * kv_bytes_per_token + fixed_per_sequence + graph_bytes_per_state
    return max(0, int(free_bytes) - int(scratch_bytes + margin_bytes)) // max(1, per)


# One model-level graph (decode_batch widths, verify / commit groups, mtp-batch chains; shared by every set of
# states): measured 0.74 MiB each on the 27B (27 graphs, 20.0 MiB: `bench load`, docs/PERF.md 2026-12-06 third
# session; d12 read 2 MiB each for four decode_batch widths, at cudaMemGetInfo's 2 MiB pages); reserved at 2 MiB,
# every possible key counted (batch_graph_reserve), and enforced: GraphCache runs a new key eagerly past it.
BATCH_GRAPH_BYTES = 2 << 20


# One model-level mtp-batch graph step (FastModel.mtp_draft_batch, graphs keyed ("mtp-batch", rows,
# chains, depth)): each step of a chain graph runs the MTP layer (the lane store, grouped attention, MLP)
# plus the embed, the two pre-norms and fc, the final norm, mtp_gather_last, the lm_head, top2 and
# mtp_chain_step_lanes -- about two layers' kernel nodes. BATCH_GRAPH_BYTES (a 64-layer graph, reserved at
# ~2.7x its measured 0.74 MiB) is 32 KiB per layer, so 64 KiB per step; a graph of depth d takes d steps. An estimate, not measured on the device yet (GraphCache.model_bytes would measure it).
MTP_BATCH_STEP_BYTES = 2 * BATCH_GRAPH_BYTES // 64


def lane_group_pairs(max_batch: int, lanes: int) -> int:
    """(rows, groups) pairs of a sweep of at most `lanes` rows cut into 1 <= groups <= min(max_batch, rows)
    groups of at least one row: the keys of verify_batch's graphs, and per depth of mtp_draft_batch's
    (136 for 16 and 16)."""
    return sum(min(int(max_batch), rows) for rows in range(1, max(0, int(lanes)) + 1))


def mtp_batch_graph_keys(max_batch: int, mtp_lanes: int, depth: int) -> int:
    """The ("mtp-batch", rows, chains, d) keys FastModel.mtp_draft_batch can capture: rows <= mtp_lanes
    step-0 rows of a part (mtp_batch_parts), 1 <= chains <= min(max_batch, rows) (every chain has at least
    one row; LocalEngine.run_drafts hands max_batch chains at a time), and every depth d = 1..depth (the
    engine asks for its deepest chain's, any of them): 136 x depth for 16 and 16."""
    return lane_group_pairs(max_batch, mtp_lanes) * max(0, int(depth))


def mtp_batch_graph_reserve(max_batch: int, mtp_lanes: int, depth: int) -> int:
    """Bytes mtp_batch_graph_keys' graphs can take: per (rows, chains) pair one graph of each depth
    d = 1..depth, d x MTP_BATCH_STEP_BYTES each (so the keys x the mean depth's graph)."""
    d = max(0, int(depth))
    return lane_group_pairs(max_batch, mtp_lanes) * (d * (d + 1) // 2) * MTP_BATCH_STEP_BYTES


def batch_graph_reserve(max_batch: int, verify_lanes: int = 0, *, mtp_lanes: int = 0, mtp_depth: int = 0) -> int:
    """Bytes the model-level batch graphs can take: one graph per width 2..max_batch (the scheduler
    runs a shared sweep at every width from two slots up to the sweep's lane limit), and with
    verify_batch (verify_lanes > 0) one per (lanes, groups) of a sweep with drafts -- 1 <= groups <=
    min(max_batch, lanes), lanes <= verify_lanes: 136 for 16 and 16 -- plus one commit graph per group
    count (FastModel.verify_batch / commit_batch key their graphs so).

    With batched MTP drafting (mtp_lanes = FastModel.mtp_batch_lanes > 0, mtp_depth = the deepest chain
    one call runs, forward.MTP_CHAIN_DEPTH) the mtp-batch chain graphs too (mtp_batch_graph_reserve):
    they are model-level graphs like the others (GraphCache.run_model, never dropped with a state, not in
    bytes_by_state, so not in the per-state graph_bytes_per_layer either), captured on a key's second
    sighting; without them the window was sized as if they took nothing. 0 / 0 (the defaults): none."""
    graphs = max(0, int(max_batch) - 1)
    v = max(0, int(verify_lanes))
    if v:
        graphs += lane_group_pairs(max_batch, v) + min(int(max_batch), v)
    return graphs * BATCH_GRAPH_BYTES + mtp_batch_graph_reserve(max_batch, mtp_lanes, mtp_depth)


def plan_slots(free_bytes: int, kv_bytes_per_token: int, *, max_slots, max_context, max_sequences: int,
               kv_format: str = "?", fixed_per_sequence: int = 0, graph_bytes_per_state: int = 0,
               scratch_bytes: int = 0, margin_bytes: int = 0, max_positions: int | None = None,
               cap: int = 8, floor: int = 2, align: int = WINDOW_ALIGN) -> SlotPlan:
    """The slot count and the window, consistent with each other (issue 15; EngineConfig.max_slots).

    Every slot owns one live sequence state (a full window of KV rows, the GDN + conv state, and
    the CUDA graphs captured for that state), and the prefix cache keeps max_sequences states even
    when fewer slots run, so the card holds max(max_sequences, slots) states at the window.

    - max_slots N, max_context "auto": the window is sized for max(max_sequences, N) states
      (context_window), as before slots were sized.
    - max_slots "auto", max_context "auto": the window comes first, sized for
      max(max_sequences, floor) states (the window a user gets does not shrink below today's for
      the default max_sequences); then the slots are every state that fits at that window, at
      most `cap`. So a memory-limited window gives max(max_sequences, floor) slots, and a window
      capped by the model (big cards) leaves room for more, up to `cap`. Where not even `floor`
      states fit a window of `align` positions, fewer are tried down to max_sequences (whose
      states the prefix cache allocates anyway; no room for those is context_window's error).
    - max_slots "auto", max_context N: the states of N positions that fit, between 1 and `cap`
      (1 when not even one fits: the old single-slot behaviour, and its allocation error).
    """
    positions = max_positions
    graph_per = int(graph_bytes_per_state)

    def window_for(sequences: int) -> ContextBudget:
        return context_window(free_bytes, kv_bytes_per_token, kv_format=kv_format, sequences=sequences,
                              fixed_per_sequence=fixed_per_sequence + graph_per, scratch_bytes=scratch_bytes,
                              margin_bytes=margin_bytes, max_positions=positions, align=align)

    def with_sequences(budget: ContextBudget, sequences: int) -> ContextBudget:
        reserved = int(scratch_bytes + margin_bytes + sequences * (fixed_per_sequence + graph_per))
        return ContextBudget(budget.window, budget.kv_format, budget.bytes_per_token, sequences,
                             budget.free_bytes, reserved, budget.limited_by)

    def fixed_budget(window: int, sequences: int) -> ContextBudget:
        limited = "model" if positions is not None and window >= positions else "flag"
        window = min(window, positions) if positions is not None else window
        return with_sequences(ContextBudget(window, kv_format, kv_bytes_per_token, sequences, int(free_bytes), 0,
                                            limited), sequences)

    def fit_at(window: int) -> int:
        return states_fit(free_bytes, window, kv_bytes_per_token, fixed_per_sequence=fixed_per_sequence,
                          graph_bytes_per_state=graph_per, scratch_bytes=scratch_bytes, margin_bytes=margin_bytes)

    auto_window = not isinstance(max_context, int)
    state = lambda w: w * kv_bytes_per_token + fixed_per_sequence + graph_per  # noqa: E731
    if isinstance(max_slots, int):
        slots = max(1, max_slots)
        sequences = max(1, max_sequences, slots)
        budget = window_for(sequences) if auto_window else fixed_budget(int(max_context), sequences)
        return SlotPlan(slots, budget, state(budget.window), fit_at(budget.window), "flag")
    if auto_window:
        base = max(1, max_sequences, floor)
        budget = None
        least = max(1, max_sequences)  # the prefix cache's states must fit, as before slots were sized
        for sequences in range(base, least - 1, -1):  # the floor gives way before the window does
            try:
                budget = window_for(sequences)
                break
            except ValueError:
                if sequences == least:
                    raise
        fit = max(budget.sequences, fit_at(budget.window))
    else:
        budget = fixed_budget(int(max_context), max(1, max_sequences))
        fit = fit_at(budget.window)
    slots = max(1, min(cap, fit))
    limited = "cap" if fit > cap else "memory"
    return SlotPlan(slots, with_sequences(budget, max(1, max_sequences, slots)), state(budget.window), fit, limited)
