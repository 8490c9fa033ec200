"""Decoding one sequence: prefill, then rounds that each commit one or more tokens.

This is the plain (non-speculative) decoder: one token per round. The
speculative decoder (engine/spec.py) keeps the same interface and, for the same
seed, emits exactly the same tokens (engine/sampling.py explains why).

Conventions shared by both decoders:
- `run` continues from state.position: prompt tokens before it are taken as
  already in the state (prefix reuse), the rest are prefilled.
- A round is one main-model forward that decides tokens; the prefill is the
  first round (it decides the first token). The last emitted token is never run
  through the model (as in plain decoding), so when generation ends the state
  holds prompt + output minus the last token.
- state.hidden_last is kept as the post-norm hidden at position - 1:
  what the MTP head needs to resume a restored state (set after a prefill's last piece
  and at each of its breaks; between two pieces it is None, not fetched).
- `pace` (the scheduler's Pace, engine/scheduler.py) is read before every step: a
  prefill piece is capped at pace.prefill_chunk, and when pace.shared a decode round
  does not run its own forward: the decoder yields a Lane (its pending token), the
  caller runs it in the round's shared model.decode_batch and puts the output in it,
  and the resumed decoder finishes the round from there. Without a pace (generate(),
  the CLI, tests) every round runs alone, exactly as before.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterator, TypeVar

import numpy as np

from q27py.engine.api import SamplingParams
from q27py.engine.sampling import TokenPicker, validate
from q27py.model.state import SequenceState

SOURCES = ("none", "mtp", "suffix")
T = TypeVar("T")


@dataclass
class DecodeStats:
    """What happened in one request, counted as it happened."""

    rounds: int = 0
    generated: int = 0
    record_trace: bool = False
    trace: list = field(default_factory=list)  # per round: {"source", "drafts", "accepted"}
    rounds_by_source: dict = field(default_factory=lambda: {s: 0 for s in SOURCES})
    # Per source, index k-1: drafts proposed at depth k / of those, accepted.
    drafted_by_depth: dict = field(default_factory=lambda: {"mtp": [], "suffix": []})
    accepted_by_depth: dict = field(default_factory=lambda: {"mtp": [], "suffix": []})
    mtp_steps: int = 0  # MTP layer passes (draft steps; step 0 also writes committed rows)
    lanes: int = 0  # tokens run through the main model after the prefill (decode + verify lanes)

    def record_round(self, source: str, drafts: list[int], accepted_drafts: int, emitted: int,
                     lanes: int = 0, mtp_steps: int = 0) -> None:
        """One round: `drafts` verified, the first `accepted_drafts` accepted, `emitted` tokens committed."""
        assert 0 <= accepted_drafts <= len(drafts) and accepted_drafts <= emitted
        self.rounds += 1
        self.generated += emitted
        self.rounds_by_source[source] += 1
        self.lanes += lanes
        self.mtp_steps += mtp_steps
        if drafts:
            proposed, accepted = self.drafted_by_depth[source], self.accepted_by_depth[source]
            while len(proposed) < len(drafts):
                proposed.append(0)
                accepted.append(0)
            for k in range(len(drafts)):
                proposed[k] += 1
                accepted[k] += k < accepted_drafts
        if self.record_trace:
            self.trace.append({"source": source, "drafts": [int(t) for t in drafts], "accepted": int(emitted),
                               "lanes": int(lanes), "mtp_steps": int(mtp_steps)})

    def acceptance_by_depth(self, sources=("mtp", "suffix")) -> list[float]:
        """Share of drafts proposed at depth k (1-based: index k-1) that were accepted."""
        depth = max((len(self.drafted_by_depth[s]) for s in sources), default=0)
        out = []
        for k in range(depth):
            p = sum(self.drafted_by_depth[s][k] for s in sources if k < len(self.drafted_by_depth[s]))
            a = sum(self.accepted_by_depth[s][k] for s in sources if k < len(self.accepted_by_depth[s]))
            out.append(a / p if p else 0.0)
        return out

    def as_dict(self) -> dict:
        d = {
            "rounds": self.rounds,
            "tokens_per_round": (self.generated / self.rounds) if self.rounds else 0.0,
            "rounds_by_source": dict(self.rounds_by_source),
            "share_by_source": {s: (n / self.rounds if self.rounds else 0.0) for s, n in self.rounds_by_source.items()},
            "acceptance_by_depth": self.acceptance_by_depth(),
            "acceptance_by_depth_by_source": {s: self.acceptance_by_depth((s,)) for s in ("mtp", "suffix")},
            "drafted_by_depth": [sum(v) for v in _zip_longest(self.drafted_by_depth["mtp"], self.drafted_by_depth["suffix"])],
            "mtp_steps": self.mtp_steps,
            "verify_lanes": self.lanes,
            # raw counts, for metrics that sum over requests (ratios do not add up)
            "drafted_by_source": {s: sum(self.drafted_by_depth[s]) for s in ("mtp", "suffix")},
            "accepted_by_source": {s: sum(self.accepted_by_depth[s]) for s in ("mtp", "suffix")},
            "accepted_by_depth": [sum(v) for v in _zip_longest(self.accepted_by_depth["mtp"], self.accepted_by_depth["suffix"])],
        }
        if self.record_trace:
            d["trace"] = list(self.trace)
        return d


def _zip_longest(a: list[int], b: list[int]) -> list[tuple[int, int]]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0, b[i] if i < len(b) else 0) for i in range(n)]


# position -> callback(state) (prefix snapshots). A callback with a true `reads_mtp` attribute reads
# the MTP rows too (a disk prefix entry exports them): the speculative decoder writes any MTP rows it
# holds back for the first token (engine/spec.py) before calling it.
PrefillBreaks = dict[int, Callable[[SequenceState], None]]


def reads_mtp(callback) -> bool:
    """Whether a prefill break's callback reads the MTP rows of the positions before it."""
    return bool(getattr(callback, "reads_mtp", False))


def restarts_grid(callback) -> bool:
    """Whether a prefill break is a boundary mark (a system / stable snapshot) the chunk grid restarts
    at (chunk_cuts)."""
    return bool(getattr(callback, "restarts_grid", False))


def chunk_cuts(start: int, end: int, chunk: int, restarts=()) -> list[int]:
    """The full-chunk cuts of a prefill of positions start..end: every `chunk` tokens from `start`,
    the grid starting over at each position in `restarts` (the boundary marks, themselves cuts).
    Why restart: a mark cuts a piece anyway, and a grid kept from `start` would then leave a short
    piece just after it (bench replay's cold 25K turn: a system mark at 20,234, then a 246-token
    piece to 20,480), which on cuda streams every bf16 expansion (~16 ms) for a few tokens; and a
    warm turn restored at that mark cuts from it, so after the mark a cold run now cuts as the warm
    one does. Cuts strictly inside (start, end), ascending."""
    bounds = sorted({start, *(r for r in restarts if start < r < end)}) + [end]
    cuts = []
    for a, b in zip(bounds, bounds[1:]):
        cuts.extend(range(a + chunk, b, chunk))
    return cuts


@dataclass
class Pace:
    """What the scheduler asks of a slot's next step; it sets both fields before every resume.

    shared: a decode round runs as one lane group of the round's shared forward (the decoder yields
        a Lane instead of calling the model); False: the decoder's own round (speculative, if on).
    prefill_chunk: at most this many prompt tokens in the next prefill piece (None: the decoder's
        full chunk). Pieces tile the full chunks' grid, so every cut of an unpaced run stays a cut.
    """

    shared: bool = False
    # lanes this slot's group of a shared round may take: its pending token and up to lanes - 1 drafts
    # (the scheduler's share of the sweep's flat width, LocalEngine.sweep_lanes); 1: a plain lane
    lanes: int = 1
    # with drafts in the group: hand the MTP ladder's chain out (engine/spec.py DraftCall) so that the
    # round runs every sharing slot's chain in one batch (LocalEngine.batch_drafts)
    batch_drafts: bool = False
    # written by the stepper after each decode round: lanes its next round's group would use at most (its
    # drafters' reach, DraftPlanner.wanted); None: unknown (an even share). share_policy.share_lanes
    want_lanes: int | None = None
    prefill_chunk: int | None = None
    # written by the stepper: prompt tokens still to prefill (None until its prefill has started);
    # the scheduler ranks prefilling slots by it (a warm turn restored from the prefix cache has few)
    prefill_left: int | None = None
    # prefill_chunk is the piece at position 0; at position p it is prefill_chunk / (1 + p / halving)
    # (0: the same everywhere). A piece's attention grows with the keys it reads, so this keeps the
    # piece's time -- the other slots' wait -- about flat over a long prompt (EngineConfig.interleave_halving).
    halving: int = 0


class Lane:
    """One lane group a decoder hands its caller instead of running the forward itself.

    A plain lane (no drafts): `token` runs at state.position in commit mode, in a model.decode_batch
    over several sequences (LocalEngine.run_lanes). With drafts (a shared round that carries them,
    Pace.lanes > 1): `tokens` = [token, *drafts] run in verify mode, every sharing slot's group in
    one model.verify_batch, and the caller commits each group's accepted tokens (commit_batch) right
    after every group has read its output. Either way the caller calls take(out) with this group's
    output before the next model call of any state (on the fast path the batch's outputs live in
    shared scratch until then), and then resumes the decoder, which finishes its round from
    result(). take() only reads: the picks (the request's own TokenPicker on this group's own rows,
    walking the drafts as a solo round does: accept_walk) and a copy of the hidden rows (what the
    MTP ladder is fed). Nothing here calls the model, so every group of a batch reads before any of
    them moves on (an MTP flush, a finished stream putting its state at rest).
    """

    def __init__(self, state: SequenceState, token: int, picker: TokenPicker, drafts=(), stop_ids=frozenset()):
        self.state = state
        self.token = int(token)
        self.drafts = [int(t) for t in drafts]  # guesses for the positions after `token`'s
        self.stop_ids = stop_ids  # the walk ends at one (accept_walk)
        self.position = state.position  # where `token` runs
        self._picker = picker
        self.picked: list[int] | None = None  # the tokens chosen from the rows (at position + 1 ..)
        self.hidden: np.ndarray | None = None  # [len(picked), H] post-norm hidden rows, a host copy
        self.trace = None  # a verify group's trace (commit_batch keeps len(picked) of its tokens)
        self.error: BaseException | None = None

    @property
    def tokens(self) -> list[int]:
        """What the group runs: its pending token, then its drafts."""
        return [self.token, *self.drafts]

    def take(self, out, verified: bool = False) -> None:
        """Read this group's output of the shared forward (no model call). verified: it ran in a
        verify_batch (the state has not moved yet: commit_batch follows); else in a decode_batch,
        which committed the one token."""
        if verified:
            if self.state.position != self.position:
                raise RuntimeError(f"verify_batch moved a state from {self.position} to {self.state.position}")
            self.picked = accept_walk(self._picker, out, self.position, self.drafts, self.stop_ids)
            self.hidden = np.array(out.hidden[: len(self.picked)])
            self.trace = out.trace
            return
        if self.state.position != self.position + 1:
            raise RuntimeError(f"decode_batch moved a state from {self.position} to {self.state.position}, not by one")
        self._picker.prefetch(out, [])  # a device-masked pick in one launch (if on), as a solo round's
        self.picked = [self._picker.pick_output(out, 0, self.state.position)]
        self.hidden = np.array(out.hidden[-1:])

    def fail(self, exc: BaseException) -> None:
        """The shared forward, or this lane's read of it, failed: the resumed decoder raises it."""
        self.error = exc

    def result(self) -> tuple[list[int], np.ndarray]:
        """(tokens committed, their hidden rows [n, H])."""
        if self.error is not None:
            raise self.error
        if self.picked is None:
            raise RuntimeError("a decode lane was resumed before its shared forward ran")
        return self.picked, self.hidden


def accept_walk(picker: TokenPicker, out, position: int, drafts: list[int], stop_ids) -> list[int]:
    """The tokens a verify forward of [pending, *drafts] at `position` commits (engine/spec.py step 3):
    row t's pick is the token at position + t + 1 (the position-keyed sampler: the token a plain step
    there picks); the walk goes on only while that pick equals draft t + 1 (so row t + 1 saw the right
    prefix) and is no stop id. A solo round and a shared round's verify group both walk here."""
    picker.prefetch(out, drafts)  # device-masked picks of every row in one launch (if on)
    new: list[int] = []
    for t in range(len(drafts) + 1):
        tok = picker.pick_output(out, t, position + t + 1, drafts[:t])
        new.append(tok)
        if tok in stop_ids or t >= len(drafts) or tok != drafts[t]:
            break
    return new


class PrefillCancelled(Exception):
    """The request's cancel flag was set between prefill chunks (issue 13.4)."""


def prefill(model, state: SequenceState, ids: list[int], chunk: int,
            breaks: PrefillBreaks | None = None, on_chunk=None,
            cancel: threading.Event | None = None) -> np.ndarray:
    """Feed ids at state.position.. in chunks; returns the logits row after the last one.

    Chunks also end at every position in `breaks`, whose callback then sees the
    state there (prefix-reuse snapshots); a break at the start position runs before the
    first chunk, one at the end after the last. on_chunk(start, chunk_ids, hidden) sees
    every chunk's post-norm hidden states (the MTP warm-up). Both decoders prefill
    through here, so their first logits are the same bits. `cancel` is checked between
    chunks, so a disconnect during a long prefill frees the engine after one chunk
    (PrefillCancelled; the caller drops the partly filled state).
    """
    return drive(prefill_steps(model, state, ids, chunk, breaks, on_chunk, cancel))


def prefill_steps(model, state: SequenceState, ids: list[int], chunk: int,
                  breaks: PrefillBreaks | None = None, on_chunk=None,
                  cancel: threading.Event | None = None,
                  pace: Pace | None = None) -> Generator[None, None, np.ndarray]:
    """prefill(), pausing (a bare `yield`) between chunks; its return value is the last logits row.

    The scheduler (engine/scheduler.py) interleaves other slots' decode rounds at these
    pauses, so a long prompt delays running streams by one chunk at a time. A pause sits
    after a chunk's callbacks and before the cancel check of the next one: a paused
    prefill holds no pending model work.

    Cuts: every `chunk` tokens from the start, the grid starting over at each boundary mark
    (a break whose callback restarts_grid: chunk_cuts), and at every break strictly inside
    the prompt. A break at the start position runs first, on the state as it stands (a snapshot of
    the resume point: no piece, no pause); a break at the end runs after the last piece, on
    the state that holds the whole prompt. pace.prefill_chunk (read
    before each piece: the scheduler sets it while other slots are decoding) cuts a piece
    shorter; the next piece resumes there and the full-chunk cuts stay where they were, so an
    unpaced run's cuts are always among a paced run's.
    """
    assert ids, "prefill needs at least one token"
    # A model that splits long forwards itself returns hidden rows of its last split
    # only (the fast path's `chunk`); feeding it no more than that keeps every row.
    chunk = min(chunk, model.chunk or chunk)
    start, end = state.position, state.position + len(ids)
    marks = sorted(p for p in (breaks or {}) if start < p < end)
    grid = chunk_cuts(start, end, chunk, [p for p in marks if restarts_grid(breaks[p])])
    if breaks and start in breaks:
        breaks[start](state)  # the resume point itself (a checkpoint snapped there): before any forward
    last, done = None, start
    while done < end:
        if pace is not None:
            pace.prefill_left = end - done
        if done > start:
            yield
            if cancel is not None and cancel.is_set():
                raise PrefillCancelled(f"cancelled after {done - start} of {len(ids)} prefill tokens")
        cut = min([end, *(c for c in grid if c > done), *(m for m in marks if m > done)])
        small = pace.prefill_chunk if pace is not None else None
        if small and pace.halving > 0:
            small = max(1, round(small / (1 + done / pace.halving)))
        if small and small < cut - done:
            cut = done + small
        piece = ids[done - start : cut - start]
        final = cut == end
        # Only the prompt's last row needs logits (the first token); a piece before it asks for none.
        # And only a break and the prompt's end read hidden_last (a snapshot keeps it; the decoder
        # resumes from it): elsewhere it is not fetched. On the fast path each of those host reads
        # is a device sync, so a cold prompt's pieces now run back to back -- the host enqueues piece
        # k + 1 while the device still runs piece k -- instead of idling the device at every cut.
        out = model.forward(state, piece, logits_rows="last" if final else "none")
        # both read before on_chunk's MTP calls: on the fast path any later model call may reuse the
        # scratch an output lives in. The hidden rows stay in the model's memory (a device array on
        # the fast path, its copy queued on the model's stream, not waited for: the MTP warm-up reads
        # them there, in order; host_rows below waits where the host reads one).
        hidden = out.hidden_owned(wait=False)
        if final:
            last = out.logits[-1]
        if final or (breaks and cut in breaks):
            state.hidden_last = host_rows(hidden[-1:]).copy()
        else:
            state.hidden_last = None  # mid-prompt, unread: set at the next break or the end
        if on_chunk is not None:
            on_chunk(done, piece, hidden)
        done = cut
        if breaks and cut in breaks:
            breaks[cut](state)
    if pace is not None:
        pace.prefill_left = 0
    return last


def host_rows(a) -> np.ndarray:
    """A host array of rows that may live on the device (ForwardOutput.hidden_owned's). Device rows may
    still be in flight on the model's stream (hidden_owned(wait=False)): the device is synchronized
    first (the only host read of a prefill piece's rows: at a break and at the prompt's end)."""
    if isinstance(a, np.ndarray):
        return a
    import cupy as cp  # only reached with device rows, i.e. on the fast path

    cp.cuda.Device().synchronize()
    return a.get()


def drive(steps: Generator[None, None, T]) -> T:
    """Run a stepping generator (prefill_steps) to its end without pausing; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def paused(steps: Generator[None, None, T], pause: bool) -> Generator[list[int], None, T]:
    """Relay a stepping generator inside a decoder's run: each pause becomes an empty round
    (no tokens) when `pause`, else the steps run straight through. Returns its value."""
    if not pause:
        return drive(steps)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        yield []


def begin_run(sampling: SamplingParams, stats: DecodeStats | None, trace: bool,
              picker: TokenPicker | None = None, prompt_ids=()) -> tuple[TokenPicker, DecodeStats]:
    """What every decoder does first: check the sampling settings, set up the token picker
    (the engine passes one carrying the request's constraint and logprobs), set up stats."""
    validate(sampling)
    stats = stats if stats is not None else DecodeStats()
    stats.record_trace = stats.record_trace or trace
    return (picker if picker is not None else TokenPicker(sampling, prompt_ids)), stats


def prompt_suffix(state: SequenceState, prompt_ids: list[int]) -> list[int]:
    """The prompt tokens not yet in the state (all of them for a fresh state)."""
    if not 0 <= state.position < len(prompt_ids):
        raise ValueError(f"state holds {state.position} tokens; the prompt has {len(prompt_ids)} (need at least one to prefill)")
    return list(prompt_ids[state.position :])


class Decoder:
    """Plain decoding: prefill in chunks, then one forward per token."""

    def __init__(self, model, prefill_chunk: int = 2048, trace: bool = False):
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.trace = trace

    def prefill(self, state: SequenceState, ids) -> np.ndarray:
        """Feed prompt tokens (in chunks) from state.position; returns the logits of the last one."""
        return prefill(self.model, state, list(ids), self.prefill_chunk)

    def run(
        self,
        state: SequenceState,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids=frozenset(),
        cancel: threading.Event | None = None,
        stats: DecodeStats | None = None,
        prefill_breaks: PrefillBreaks | None = None,
        picker: TokenPicker | None = None,
        pause_prefill: bool = False,
        pace: Pace | None = None,
    ) -> Iterator[list[int] | Lane]:
        """Yield the tokens committed by each round until a stop id, max_tokens or cancel.

        pause_prefill: also yield an empty round between prefill chunks (the scheduler's
        bounded unit of work). Every yield of tokens comes after the round's token is picked
        and committed: a paused run holds no pending work, so other sequences' rounds may run
        on the same model between any two of them. pace: the module docstring (a Lane is
        yielded where a shared round's forward would run).
        """
        sampler, stats = begin_run(sampling, stats, self.trace, picker, prompt_ids)
        if max_tokens <= 0 or (cancel is not None and cancel.is_set()):
            return
        logits = yield from paused(prefill_steps(self.model, state, prompt_suffix(state, prompt_ids),
                                                 self.prefill_chunk, prefill_breaks, cancel=cancel, pace=pace),
                                   pause_prefill)
        if sampler.finished:  # a constraint that admits nothing at all (and no end id to emit)
            return
        tok = sampler.pick(logits, state.position)
        produced = 0
        while True:
            sampler.commit([tok])
            produced += 1
            stats.record_round("none", [], 0, 1, lanes=1 if produced > 1 else 0)
            yield [tok]
            # sampler.finished: a constrained output is complete and there is no end id to emit
            # (TokenPicker.finished); the speculative decoder ends after the same token.
            if (tok in stop_ids or produced >= max_tokens or sampler.finished
                    or (cancel is not None and cancel.is_set())):
                return
            if pace is not None and pace.shared:
                lane = Lane(state, tok, sampler)
                yield lane  # the caller runs it in the round's decode_batch and reads its output into it
                picked, state.hidden_last = lane.result()
                tok = picked[0]
                continue
            out = self.model.forward(state, [tok])
            state.hidden_last = out.hidden[-1:].copy()
            # picked here, before the next yield: the output rows are read before any other model call
            tok = sampler.pick_output(out, 0, state.position)
