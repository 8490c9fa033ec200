"""Where draft tokens come from: the MTP ladder, the suffix drafter, and the choice between them.

A draft is only a guess: verification decides what is emitted, so nothing here
can change the output, only how many tokens each verify forward commits.

- MTPLadder chains the model's single MTP layer (model.md §5): step 0 is the MTP
  row of the last committed position with the pending token; step k feeds the
  MTP's own post-norm output, draft k and the next position. Its KV rows of
  committed positions are kept warm; draft rows are dropped after each ladder.
- SuffixIndex finds the longest earlier occurrence of the context tail in
  prompt + output and proposes what followed it (code repeats itself).
- DepthController floats the ladder's depth ceiling from what verification accepts.
- DraftPlanner picks a drafter per round (SpecConfig.arbitration).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from q27py.config import SpecConfig
from q27py.model.state import KVCache

NONE, MTP, SUFFIX = "none", "mtp", "suffix"


@dataclass
class Draft:
    source: str  # NONE | MTP | SUFFIX
    tokens: list[int] = field(default_factory=list)
    gated: bool = False  # MTP: the confidence gate stopped the ladder before the depth ceiling
    mtp_steps: int = 0  # MTP layer passes run for this round (warming included in step 0)


def top2_margin(logits: np.ndarray) -> float:
    """top1 - top2 logit: how sure the head is of its first choice."""
    if logits.shape[0] < 2:
        return float("inf")
    top = np.partition(logits, -2)[-2:]
    return float(top[1] - top[0])


def concat_rows(blocks: list) -> np.ndarray:
    """The ladder's queued row blocks as one array: numpy when all are host blocks, else on the device
    (host blocks, e.g. a restored hidden_last row, uploaded)."""
    if len(blocks) == 1:
        return blocks[0]
    if all(isinstance(b, np.ndarray) for b in blocks):
        return np.concatenate(blocks)
    import cupy as cp  # only reached with device rows, i.e. on the fast path

    # the blocks may still be in flight on the model's stream (a prefill piece's rows: hidden_owned(wait=
    # False)), and this runs on another one: every stream of the device done first
    cp.cuda.Device().synchronize()
    rows = cp.concatenate([cp.asarray(b) for b in blocks])
    cp.cuda.get_current_stream().synchronize()  # complete before the model's own stream reads it
    return rows


class MTPLadder:
    """The MTP draft chain plus the bookkeeping that keeps the MTP KV cache warm.

    The MTP row of position p pairs the main model's post-norm hidden at p with the
    token at p+1, so it can only be written once that token is known. Rows whose
    next token is known but that are not yet written wait in a backlog; the next
    ladder writes them in the same pass as its step 0 (whose row is the last one:
    the last committed position with the pending token). Invariant between rounds:
    kv.length + backlog == committed position, backlog >= 1.

    Held writes (`hold` .. `release`): while a prompt prefills, the writes its pieces
    make (each flush's one mtp_forward) can be kept back, in order, instead of run: the
    first token is chosen from the main model's last logits row alone, so the spec
    decoder sends it out first and then `release`s them, before any draft. The same
    calls run on the same rows in the same order, only later, so the MTP KV a draft
    reads is the bits of eager writing. While holding, kv.length + held_rows + backlog
    == position. A HoldBudget bounds the rows held by every ladder of an engine: past
    it, the earliest held writes run at once (eagerly, as without holding).
    """

    # A long run of suffix rounds would grow the backlog without bound; past this
    # many rows it is written eagerly (all but the last, which step 0 needs).
    MAX_BACKLOG = 256

    def __init__(self, model, kv: KVCache):
        self.model = model
        self.kv = kv
        self._hidden: list[np.ndarray] = []  # [rows, H] blocks, positions kv.length + held_rows..
        self._next: list[int] = []
        self.holding = False
        self._held: list[tuple[object, list[int]]] = []  # writes kept back: (rows, next ids), in order
        self.held_rows = 0
        self._budget: HoldBudget | None = None

    @property
    def backlog(self) -> int:
        return len(self._next)

    def hold(self, budget: "HoldBudget") -> None:
        """Keep back the MTP writes from now on (the prompt's, while it prefills) until release();
        `budget` bounds the rows held across its ladders (the earliest run at once past it)."""
        self._budget = budget
        budget.join(self)
        self.holding = True

    def release(self) -> None:
        """Stop holding and run every held write, in order (the rows' MTP KV is then exactly eager's)."""
        self.holding = False
        self._run_held()

    def write_held(self) -> None:
        """Run the held writes now and go on holding (a snapshot that exports the MTP rows is next)."""
        self._run_held()

    def discard(self) -> None:
        """Stop holding and drop the held writes unrun: the state they were for is being thrown away
        (a prefill cancelled or failed before its first token), so they must never reach it later."""
        self.holding = False
        self._held, self.held_rows = [], 0

    def _run_held(self, keep_rows: int = 0) -> None:
        """Run held writes, earliest first, until at most keep_rows rows stay held."""
        while self._held and self.held_rows > keep_rows:
            rows, ids = self._held.pop(0)
            self.held_rows -= len(ids)
            self.model.mtp_forward(self.kv, rows, ids, self.kv.length, logits_rows="none")

    def _write(self, rows, ids: list[int]) -> None:
        """One warm-up write (the MTP KV rows of `rows`, at the next unwritten positions): run now,
        after any held before it, or kept back while holding (within the budget)."""
        if not self.holding:
            self._run_held()
            self.model.mtp_forward(self.kv, rows, ids, self.kv.length, logits_rows="none")
            return
        self._held.append((rows, ids))
        self.held_rows += len(ids)
        over = self._budget.held() - self._budget.limit
        if over > 0:
            self._run_held(keep_rows=max(0, self.held_rows - over))

    def defer(self, hidden: np.ndarray, next_ids) -> None:
        """Queue rows: main hidden at the next unwritten positions, and the token after each. Rows on
        the device (a fast-path prefill's, ForwardOutput.hidden_owned) stay there."""
        self._hidden.append(hidden if hasattr(hidden, "__cuda_array_interface__") else np.asarray(hidden))
        self._next.extend(int(t) for t in next_ids)
        if len(self._next) > self.MAX_BACKLOG:
            self.flush(keep_last=True)

    def flush(self, keep_last: bool = False) -> None:
        """Write the queued rows now (keep_last: all but the newest, which step 0 will write)."""
        keep = 1 if keep_last else 0
        if len(self._next) <= keep:
            return
        rows = concat_rows(self._hidden)
        cut = len(self._next) - keep
        self._write(rows[:cut], self._next[:cut])
        self._hidden, self._next = [rows[cut:]] if keep else [], self._next[cut:]

    def draft(self, max_drafts: int, min_margin: float, position: int,
              stop_if_first: Callable[[int], bool] | None = None) -> Draft:
        """Up to max_drafts drafts for positions position+1.. (`position` = the pending token's).

        Drafts are the head's argmax, also when sampling (engine/sampling.py says
        why). Stops at the first draft whose top1-top2 logit margin is below min_margin
        (that draft is dropped), or after the first draft when stop_if_first(it)
        holds (arbitration probes). Leaves the MTP KV with every committed row
        written and no draft rows.
        """
        if max_drafts <= 0:
            return Draft(NONE)
        self.release()  # (the spec decoder has released them already, after the first token)
        start = self.kv.length
        assert start + self.backlog == position, "MTP backlog out of step with the committed position"
        rows = concat_rows(self._hidden)
        if self.model.drafts_on_device:
            return self._draft_on_device(rows, max_drafts, min_margin, position, stop_if_first)
        logits, hm = self.model.mtp_forward(self.kv, rows, self._next, start, logits_rows="last")
        self._hidden, self._next = [], []
        warm_length = self.kv.length  # == position: row position-1 (step 0) is a committed row
        step_logits, h = logits[-1], hm[-1:]
        tokens: list[int] = []
        gated = False
        steps = 1
        while True:
            if top2_margin(step_logits) < min_margin:
                gated = True
                break
            tok = int(np.argmax(step_logits))
            tokens.append(tok)
            if len(tokens) >= max_drafts or (len(tokens) == 1 and stop_if_first and stop_if_first(tok)):
                break
            lg, h = self.model.mtp_forward(self.kv, h, [tok], position - 1 + len(tokens))
            step_logits = lg[0]
            steps += 1
        self.kv.truncate(warm_length)  # draft rows are guesses: never keep them
        return Draft(MTP if tokens else NONE, tokens, gated, steps)


    def _draft_on_device(self, rows, max_drafts: int, min_margin: float, position: int, stop_if_first) -> Draft:
        """The same ladder with every step chained on the device (the fast path's mtp_draft_chain):
        all max_drafts steps run in one graph, then the gate and the probe cut the list here --
        the drafts kept are exactly the host ladder's; the extra steps only cost device time."""
        call = self._chain_call(rows, max_drafts, position)
        ids, margins = self.model.mtp_draft_chain(call.kv, call.rows, call.next_ids, call.start, call.depth)
        return self.chain_result(call, ids, margins, min_margin, stop_if_first)

    def chain_call(self, max_drafts: int, position: int) -> "ChainCall":
        """What a device chain of max_drafts steps needs from this ladder -- its backlog rows and ids, the
        MTP KV and where they start -- for a caller that runs several ladders' chains in one batch
        (model.mtp_draft_batch: the scheduler's shared round, engine.run_drafts). The backlog is handed
        over (step 0 writes it); chain_result then cuts the drafts as draft() does."""
        self.release()
        assert self.kv.length + self.backlog == position, "MTP backlog out of step with the committed position"
        return self._chain_call(concat_rows(self._hidden), max_drafts, position)

    def _chain_call(self, rows, max_drafts: int, position: int) -> "ChainCall":
        call = ChainCall(self.kv, rows, list(self._next), self.kv.length, max(1, int(max_drafts)), position)
        self._hidden, self._next = [], []
        return call

    def chain_result(self, call: "ChainCall", ids, margins, min_margin: float, stop_if_first=None) -> Draft:
        """The Draft of a chain run for `call` (ids / margins of at least call.depth steps): the gate
        and the probe cut it as the host ladder stops, and the draft rows are dropped."""
        tokens: list[int] = []
        gated = False
        for k in range(call.depth):
            if margins[k] < min_margin:
                gated = True
                break
            tokens.append(int(ids[k]))
            if len(tokens) == 1 and stop_if_first and stop_if_first(tokens[0]):
                break
        self.kv.truncate(call.position)  # draft rows are guesses: never keep them
        return Draft(MTP if tokens else NONE, tokens, gated, call.depth)


@dataclass
class ChainCall:
    """One ladder's device chain (MTPLadder.chain_call): step 0 over `rows` / `next_ids` at MTP KV rows
    start.., then depth - 1 steps; position = the pending token's (the committed rows end there)."""
    kv: object
    rows: object
    next_ids: list[int]
    start: int
    depth: int
    position: int


@dataclass
class LadderAsk:
    """What DraftPlanner.plan_steps asks of the MTP ladder: up to `depth` drafts, stopping after the
    first when stop_if_first(it) holds (the "agree" probe)."""
    depth: int
    stop_if_first: Callable[[int], bool] | None = None


class HoldBudget:
    """The rows every MTPLadder of one engine may hold back at once (EngineConfig.mtp_defer_rows;
    0: none, every write runs at once). Held rows keep the prompt pieces' hidden rows alive (device
    memory on the fast path), so the bound is on all slots together. Ladders are tracked weakly: a
    ladder that goes away (its request ended) holds nothing any more."""

    def __init__(self, limit: int):
        self.limit = max(0, int(limit))
        self._ladders: weakref.WeakSet = weakref.WeakSet()

    def join(self, ladder: MTPLadder) -> None:
        self._ladders.add(ladder)

    def held(self) -> int:
        return sum(ladder.held_rows for ladder in list(self._ladders))


class SuffixIndex:
    """Incremental index of the token stream (prompt + output) for suffix drafting.

    Every `key_len`-gram maps to its most recent end positions. A proposal looks
    up the tail's key, measures how far each earlier occurrence matches backwards
    (up to max_match), keeps the longest (ties: the most recent) and copies what
    followed it. If the copy reaches the end of the stream it continues from its
    own proposal, so a period repeats. Dict keys are token tuples, so lookups have
    no false matches to guard against.
    """

    def __init__(self, key_len: int = 4, max_candidates: int = 64, max_match: int = 256):
        assert key_len >= 1
        self.key_len = key_len
        self.max_candidates = max_candidates
        self.max_match = max_match
        self._tokens = np.zeros(1024, dtype=np.int64)
        self.length = 0
        self._index: dict[tuple, list[int]] = {}

    def extend(self, ids) -> None:
        ids = [int(t) for t in ids]
        if not ids:
            return
        old, k = self.length, self.key_len
        need = old + len(ids)
        if need > self._tokens.shape[0]:
            grown = np.zeros(max(need, 2 * self._tokens.shape[0]), dtype=np.int64)
            grown[:old] = self._tokens[:old]
            self._tokens = grown
        self._tokens[old:need] = ids
        self.length = need
        # Every position `end` >= k - 1 indexes the key of the k tokens ending there, in a plain
        # list per key (ascending ends; lookups read its last max_candidates). Keys come from one
        # Python list through zip (tuples made in C): per-token numpy slices and a deque per key
        # cost ~2.5x more on a 20K-token agent prompt (docs/PERF.md).
        first = max(old, k - 1)
        if first >= need:
            return
        toks = self._tokens[first - k + 1 : need].tolist()
        index = self._index
        for end, key in zip(range(first, need), zip(*(toks[j:] for j in range(k)))):
            slot = index.get(key)
            if slot is None:
                index[key] = [end]
            else:
                slot.append(end)

    def truncate(self, length: int) -> None:
        """Forget positions >= length (a new request that shares only a prefix of this stream)."""
        length = max(0, min(length, self.length))
        k = self.key_len
        for end in range(self.length - 1, max(length, k - 1) - 1, -1):
            key = tuple(self._tokens[end - k + 1 : end + 1].tolist())
            slot = self._index.get(key)
            while slot and slot[-1] >= length:
                slot.pop()
            if slot is not None and not slot:
                del self._index[key]
        self.length = length

    def common_prefix(self, ids) -> int:
        """Length of the longest common prefix of this stream and ids."""
        n = min(self.length, len(ids))
        if n == 0:
            return 0
        diff = np.nonzero(self._tokens[:n] != np.asarray(ids[:n], dtype=np.int64))[0]
        return int(diff[0]) if diff.size else n

    def longest_match(self) -> tuple[int, int]:
        """(end position of the best earlier match of the tail, its length); (-1, 0) if none."""
        n = self.length
        if n <= self.key_len:
            return -1, 0
        key = tuple(self._tokens[n - self.key_len : n].tolist())
        ends = np.array([e for e in self._index.get(key, ())[-self.max_candidates :] if e < n - 1], dtype=np.int64)
        if ends.size == 0:
            return -1, 0
        span = min(self.max_match, n - 1)
        j = np.arange(span)
        left = ends[:, None] - j[None, :]
        tail = self._tokens[n - 1 - j]
        same = (left >= 0) & (self._tokens[np.maximum(left, 0)] == tail[None, :])
        lengths = np.where(same.all(axis=1), span, np.argmin(same, axis=1))
        best = int(lengths.max())
        end = int(ends[lengths == best].max())  # ties: the most recent occurrence
        return end, best

    def propose(self, k: int, min_match: int) -> tuple[list[int], int]:
        """(up to k drafts, match length); no drafts when the match is shorter than min_match."""
        end, length = self.longest_match()
        if k <= 0 or length < min_match:
            return [], length
        n, out = self.length, []
        for i in range(k):
            src = end + 1 + i
            out.append(int(self._tokens[src]) if src < n else out[src - n])
        return out, length


class DepthController:
    """Floats the MTP depth ceiling d in 1..max_depth from what verification accepts.

    One statistic, over MTP rounds that drafted all d drafts: full = EMA[all d
    accepted], an estimate of how often the deepest draft pays (each draft costs a
    verify lane and an MTP pass whether or not it is accepted). Promote when
    full >= promote_at: the ceiling cuts runs that would likely have gone on.
    Demote when full < demote_below: the deepest draft rarely earns its cost.
    The gap between the two thresholds is the hysteresis (after a promotion,
    full drops by one draft's conditional acceptance), and entering a level resets
    full to their midpoint, so a move must be re-earned. Rounds the confidence
    gate stopped early say nothing about the ceiling and are not counted.
    """

    def __init__(self, max_depth: int, adaptive: bool = True, ema: float = 1 / 16,
                 promote_at: float = 0.5, demote_below: float = 0.2):
        if not 1 <= max_depth <= 7:
            raise ValueError(f"max_depth must be in 1..7, got {max_depth}")
        assert demote_below < promote_at
        self.max_depth = max_depth
        self.adaptive = adaptive
        self.ema = ema
        self.promote_at = promote_at
        self.demote_below = demote_below
        self.depth = max_depth
        self.changes = 0
        self.full = (promote_at + demote_below) / 2

    def observe(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed < self.depth:
            return
        self.full += self.ema * ((1.0 if accepted >= self.depth else 0.0) - self.full)
        if self.full >= self.promote_at and self.depth < self.max_depth:
            self.depth += 1
        elif self.full < self.demote_below and self.depth > 1:
            self.depth -= 1
        else:
            return
        self.changes += 1
        self.full = (self.promote_at + self.demote_below) / 2


class DraftPlanner:
    """Per round: which drafter proposes, and how many tokens.

    Arbitration (SpecConfig.arbitration):
      "agree":        the suffix proposal (when its match is long enough) only if the MTP
                      ladder's first draft equals its first token, else the ladder; one MTP
                      pass buys a check before a wide verify (the measured default);
      "suffix_first": the suffix drafter whenever its match is long enough, else the MTP
                      ladder (q27's order: a long match in code is usually a verbatim repeat);
      "mtp":          the MTP ladder only.
    """

    POLICIES = ("agree", "suffix_first", "mtp")

    def __init__(self, cfg: SpecConfig, ladder: MTPLadder | None, suffix: SuffixIndex | None):
        if cfg.arbitration not in self.POLICIES:
            raise ValueError(f"arbitration must be one of {self.POLICIES}, got {cfg.arbitration!r}")
        self.cfg = cfg
        self.ladder = ladder
        self.suffix = suffix if cfg.suffix and cfg.arbitration != "mtp" else None
        self.depth = DepthController(cfg.max_depth, cfg.adaptive_depth) if ladder is not None else None
        # SpecConfig.pause_after: ladder rounds in a row that accepted no draft; at pause_after the
        # ladder pauses (plain rounds, a one-draft probe every pause_probe_every-th round)
        self.misses = 0
        self.idle = 0  # rounds planned since the pause began
        self.pauses = 0  # pauses begun (stats)
        self.last_proposal = 0  # drafts the suffix drafter proposed in the last plan (wanted())

    @property
    def paused(self) -> bool:
        return self.cfg.pause_after > 0 and self.misses >= self.cfg.pause_after

    def plan(self, max_drafts: int, position: int) -> Draft:
        """Drafts for the token positions after `position` (the pending token's), at most max_drafts."""
        steps = self.plan_steps(max_drafts, position)
        answer = None
        try:
            while True:
                ask = steps.send(answer)
                answer = self.ladder.draft(ask.depth, self.cfg.confidence_margin, position,
                                           stop_if_first=ask.stop_if_first)
        except StopIteration as done:
            return done.value

    def wanted(self, width: int) -> int:
        """Lanes (the pending token and its drafts) the next round would use at most -- what a shared
        round's lane share asks for (Pace.want_lanes, share_policy.share_lanes): the whole width while
        the suffix drafter's last plan had a proposal (a proposal runs as long as its match), else one
        more than the MTP ladder's depth ceiling (a single probe draft while it is paused). Never below
        two: with one lane nothing is drafted, and a drafter that never drafts never asks for more."""
        if self.last_proposal:
            return width
        if self.ladder is not None and not self.paused:
            return min(width, 1 + self.depth.depth)
        return min(width, 2)

    def plan_steps(self, max_drafts: int, position: int):
        """plan() as a generator: where it asks the MTP ladder for drafts it yields a LadderAsk and is
        sent the ladder's Draft (plan() answers at once with ladder.draft; a shared round answers from
        a chain run in one batch with the other slots' chains, engine/spec.py). Returns the Draft."""
        if max_drafts <= 0:
            return Draft(NONE)
        proposal: list[int] = []
        if self.suffix is not None:
            proposal, _ = self.suffix.propose(max_drafts, self.cfg.suffix_min_match)
        self.last_proposal = len(proposal)
        if proposal and self.cfg.arbitration == "suffix_first":
            return Draft(SUFFIX, proposal)
        if self.ladder is None:
            return Draft(SUFFIX, proposal) if proposal else Draft(NONE)
        depth = min(max_drafts, self.depth.depth)
        if self.paused:
            self.idle += 1
            if self.idle % self.cfg.pause_probe_every:
                # The ladder would pay a pass and a lane for a draft it keeps missing, and under "agree"
                # its disagreement would veto the suffix drafter's proposal, which is what a loop or a
                # verbatim copy needs (the tiny agent model's recorded tail: 4.72 tokens per round
                # with the proposal taken alone, 2.74 with the veto; docs/PERF.md f6).
                return Draft(SUFFIX, proposal) if proposal else Draft(NONE)
            depth = 1  # the probe: one draft, the cheapest round that can end the pause
        if not proposal:
            return (yield LadderAsk(depth))
        # "agree": the ladder's first step decides; when it agrees the ladder stops there.
        ladder = yield LadderAsk(depth, lambda tok: tok == proposal[0])
        if ladder.tokens and ladder.tokens[0] == proposal[0]:
            return Draft(SUFFIX, proposal, mtp_steps=ladder.mtp_steps)
        return ladder

    def observe(self, draft: Draft, accepted_drafts: int) -> None:
        if draft.source == MTP and self.depth is not None and not draft.gated:
            self.depth.observe(len(draft.tokens), accepted_drafts)
        if draft.source != SUFFIX and draft.mtp_steps > 0:  # a round the ladder itself drafted
            if accepted_drafts:
                self.misses = self.idle = 0
            else:
                self.misses += 1
                if self.misses == self.cfg.pause_after:
                    self.pauses += 1
                    self.idle = 0
