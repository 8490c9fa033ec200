"""Continuous batching on one model: slots, a FIFO queue, and rounds (issue 15).

A slot is one request in flight: the engine's resumable stepper for it (LocalEngine.steps:
each resume runs one bounded unit, a prefill chunk or a decode round, and returns its
chunk) plus the request's bookkeeping. The engine thread calls `round()` over and over:

1. queued requests whose client left are answered "cancelled" without ever starting;
2. slots whose request was cancelled are stepped once: the engine notices the flag at
   its next check and ends at once (no model work), so the slot is free before anything
   else in the round runs; an engine that does not end then is closed here;
3. free slots admit queued requests in arrival order (FIFO);
4. every active slot advances by exactly one step (`_advance`).

Step 4's shape. A slot is decoding once it has delivered a token (its next step is a
decode round or its end), else prefilling.
- Shared round: when two or more slots are decoding and the engine shares rounds
  (EngineConfig.batch_rounds, a model with decode_batch: LocalEngine.shares_rounds),
  each sharing slot is resumed with pace.shared and hands out one lane group instead of
  running its own forward: its pending token plus, where the sweep carries drafts
  (LocalEngine.sweep_lanes > 0: a model with verify_batch, batch_spec "adaptive" or
  "drafts"), up to pace.lanes - 1 drafts, pace.lanes being its share of the sweep's flat
  width (16 lanes), water-filled by what each slot's drafters would use (Pace.want_lanes,
  share_policy.share_lanes: 8 each for two slots drafting long, a plain lane each for
  sixteen). Where the engine batches drafting (batch_drafts) each sharing slot first hands
  out its MTP chain (a DraftCall) and `engine.run_drafts` runs all of them in one batch.
  Then `engine.run_lanes` runs every group in ONE weight sweep (decode_batch for plain lanes;
  verify_batch + commit_batch once any group has drafts), each group reads its own output
  rows (its request's TokenPicker walks them as a solo round does), and each slot is
  resumed again to settle, stop-check and return its tokens. A slot's drafters are fed
  every committed token either way, so its drafts are right when it runs its own round.
- Which decoding slots share: engine/share_policy.py (EngineConfig.batch_spec). "adaptive"
  (default) splits them each round by measured tokens per second -- each slot's own rounds
  (timed here, free while it runs alone) and the tokens its shared rounds yield, against
  the sweep's cost by sharing count -- so two speculating streams take their own rounds in
  turn when the sweep carries plain lanes (each ~1.6x faster than sharing on the 27B
  shapes) and share once it carries their drafts; "drafts" shares them all with drafts;
  "solo-only" shares them all with plain lanes.
- Solo round: otherwise each decoding slot runs its own full round (speculative, when
  on), in slot order, exactly as a slot alone does.
- Prefilling slots run one prefill piece each: the full chunk (engine_prefill_chunk;
  the CPU path's cpu_prefill_chunk), or, while other slots are decoding and
  EngineConfig.interleave_chunk is set, at most that many tokens, so running streams
  wait one small piece per round instead of a whole chunk (engine/decoder.py
  prefill_steps: the pieces tile the full chunks' grid). With a round budget
  (EngineConfig.interleave_budget_ms) the piece adapts: after each round that ran a piece
  beside decoding slots, the next piece is scaled by budget / that round's wall time (damped),
  so the running streams' wait holds near the budget as the prompt's context (its attention)
  grows, on any card. And while two or more prompts prefill beside decoding slots, only the
  one with the least prefill left takes a piece that round (a new one first, once, to learn
  what its prefix restore left): a title-sized request's prefill never stacks on a long
  prompt's piece in one wait (the long one resumes next round), and a warm turn with little
  left is not held behind a cold prompt that is shorter in all.

So a running stream waits at most one round between two of its steps, and a round
costs one shared decode (or one decode round per slot) plus one prefill piece per
prefilling slot. A short request admitted after a long generation finishes after about
as many rounds as it has tokens.

Nothing here knows about the model, trio or HTTP: jobs are anything with a `request`, a
`submitted` time and a `deliver(item)` (the bridge's, server/bridge.py), so the whole
policy is tested synchronously, round by round (tests/engine/test_scheduler.py). The
engine side is duck-typed: `steps(request, pace)` (or `steps(request)` / `generate`
alone: solo rounds, full chunks), plus `run_lanes`, `shares_rounds`, `sweep_lanes` and
`interleave_chunk` for the pace protocol (engine/decoder.py Pace and Lane).

Determinism: each slot's stepper runs on its own state; a shared round's lanes are
bitwise the solo decode steps they replace, its groups the solo verify forwards (the
decode_batch and verify_batch contracts), and the token
at a position is a function of its row, seed and position only (engine/sampling.py),
so a slot's tokens are the same alone, mixed, shared or speculative (tested on the
CPU paths). Interleaved prefill pieces cut the prompt differently from an unpaced run:
its rows are then rounded as a prefix-restore split rounds them (tokens equal in the
tests, not a bitwise guarantee on near ties; interleave_chunk is off by default).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from q27py.engine.api import GenerationChunk, GenerationRequest
from q27py.engine.decoder import Pace
from q27py.engine.share_policy import SharePolicy, SoloStats, share_lanes

log = logging.getLogger("q27py.scheduler")


class Job(Protocol):
    request: GenerationRequest
    submitted: float  # time.monotonic() at submission (queue-time metrics)

    def deliver(self, item) -> None:
        """Hand a GenerationChunk, or the exception the engine raised, to the consumer (any thread)."""
        ...


@dataclass
class Slot:
    index: int
    job: Job
    steps: Iterator[GenerationChunk]
    tap: object | None  # the metrics tap (server/metrics.py GenerationTap) or None
    tokens: int  # prompt + generated tokens so far (the load estimate)
    rounds: int = 0  # steps taken
    pace: Pace | None = None  # what the next resume asks of the stepper (None: an engine without pace)
    decoding: bool = False  # has delivered a token: the next step is a decode round (or the end)
    solo: SoloStats = field(default_factory=SoloStats)  # its own rounds' tokens and seconds (SharePolicy)
    # decode steps taken (own or shared). The first one is never timed for the policy: it carries the
    # prompt's deferred MTP warm-up (engine/spec.py), a one-off of up to tens of ms on a long prompt
    decode_steps: int = 0


def _prefill_left(slot: Slot) -> int:
    """Prompt tokens a prefilling slot still has to run, as its stepper last wrote it (Pace.prefill_left).
    Unknown (not yet started: the prefix restore decides it) ranks first, so a new request's first
    piece runs at once and then it takes its place: a warm turn with 800 of 25K tokens left goes
    before a cold 8K prompt. An engine without pace ranks by its prompt length."""
    if slot.pace is None:
        return slot.tokens
    return 0 if slot.pace.prefill_left is None else slot.pace.prefill_left


def engine_slots(engine) -> int:
    """Requests an engine can interleave: its max_slots (an engine without one runs one at a time)."""
    return max(1, int(getattr(engine, "max_slots", 1) or 1))


class Scheduler:
    """The slots and the queue. submit/stop/counts from any thread; wait/round from the engine thread."""

    def __init__(self, engine, max_slots: int | None = None,
                 open_tap: Callable[[Job], object | None] | None = None,
                 on_change: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter):
        self.engine = engine
        self.max_slots = max(1, int(max_slots)) if max_slots is not None else engine_slots(engine)
        # LocalEngine.steps yields after every bounded unit; an engine with generate() only
        # (scripted test engines) is stepped chunk by chunk.
        self._stepper = getattr(engine, "steps", None) or engine.generate
        # The pace protocol (module docstring): steps(request, pace) and run_lanes for shared rounds.
        self._paced = hasattr(engine, "steps") and callable(getattr(engine, "run_lanes", None))
        self._shares = self._paced and bool(getattr(engine, "shares_rounds", False))
        self._interleave = int(getattr(engine, "interleave_chunk", 0) or 0) if self._paced else 0
        self._halving = int(getattr(engine, "interleave_halving", 0) or 0) if self._paced else 0
        # the adaptive piece (module docstring): its budget in seconds (0: fixed pieces) and current size
        budget = float(getattr(engine, "interleave_budget_ms", 0) or 0) if self._interleave else 0.0
        self._budget = budget / 1000.0
        self.piece = self._interleave  # prefill tokens per piece beside decoding slots (adapts with a budget)
        self._clock = clock
        self.batched_rounds = 0  # rounds whose shared forward ran two or more lanes
        self.batched_lanes = 0  # lanes those rounds ran
        # which decoding slots share a round and which run their own (speculative) round in turn
        mode = str(getattr(engine, "batch_spec", "solo-only") or "solo-only") if self._shares else "solo-only"
        self.policy = SharePolicy(mode)
        # the most one solo round can commit (its verify width): probes that could not pay even so are skipped
        self.policy.max_yield = int(getattr(engine, "solo_yield_max", 0) or 0)
        # lanes a shared round's sweep takes in all, drafts included (LocalEngine.sweep_lanes; 0: plain
        # lanes, one per sharing slot); each sharing slot's group gets its water-filled share (Pace.lanes)
        self.sweep_lanes = int(getattr(engine, "sweep_lanes", 0) or 0) if self._shares else 0
        # the sharing slots' MTP chains run in one batch before the sweep (LocalEngine.batch_drafts, run_drafts)
        self.batch_drafts = bool(getattr(engine, "batch_drafts", False)) and self.sweep_lanes > 0
        self.solo_turns = 0  # own rounds run while two or more slots were decoding
        # wall seconds by part of a round (the load bench reports them): "shared" rounds in all, and of them
        # "drafts" (the batched MTP chains) and "sweep" (run_lanes: the verify / decode sweep, its picks
        # read back), the rest being the slots' own host work; "solo" decode rounds; "prefill" pieces
        self.seconds = {"shared": 0.0, "drafts": 0.0, "sweep": 0.0, "solo": 0.0, "prefill": 0.0}
        self._open_tap = open_tap
        self._on_change = on_change
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._slots: list[Slot | None] = [None] * self.max_slots
        self._stopping = False

    # ---- any thread -------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cond:
            if not self._stopping:
                self._queue.append(job)
                self._cond.notify_all()
                return
        job.deliver(GenerationChunk(token_ids=[], finish_reason="cancelled"))  # shutting down

    def counts(self) -> tuple[int, int, int]:
        """(running slots, queued requests, tokens held by the running slots)."""
        with self._cond:
            active = [s for s in self._slots if s is not None]
            return len(active), len(self._queue), sum(s.tokens for s in active)

    def running_requests(self) -> list[GenerationRequest]:
        with self._cond:
            return [s.job.request for s in self._slots if s is not None]

    def stop(self) -> None:
        """Cancel everything queued or running; wait() turns False once it has all ended."""
        with self._cond:
            self._stopping = True
            for job in self._queue:
                job.request.cancel.set()
            for slot in self._slots:
                if slot is not None:
                    slot.job.request.cancel.set()
            self._cond.notify_all()

    # ---- the engine thread ------------------------------------------------

    def wait(self, timeout: float | None = None) -> bool:
        """Block until there is work; False when stopping and nothing is left (or on timeout while idle)."""
        with self._cond:
            if not self._busy() and not self._stopping:
                self._cond.wait_for(lambda: self._busy() or self._stopping, timeout)
            return self._busy()

    def round(self) -> int:
        """One round (the module docstring's four parts); returns the slots that stepped."""
        self._drop_cancelled_queued()
        for slot in self._active():
            if slot.job.request.cancel.is_set():
                self._step(slot)
        self._admit()
        active = self._active()
        t0 = self._clock()
        paced_piece = self._advance(active)
        if paced_piece and self._budget > 0:
            self._adapt(self._clock() - t0)
        return len(active)

    # the adaptive piece's bounds, as fractions / multiples of interleave_chunk, and its damping
    PIECE_MIN_FRACTION, PIECE_MAX_MULTIPLE, PIECE_STEP = 8, 4, 2.0

    def _adapt(self, elapsed: float) -> None:
        """Scale the next piece by budget / elapsed (one round that ran a piece beside decoding slots)."""
        f = min(self.PIECE_STEP, max(1 / self.PIECE_STEP, self._budget / max(elapsed, 1e-6)))
        lo = max(1, self._interleave // self.PIECE_MIN_FRACTION)
        self.piece = int(min(self._interleave * self.PIECE_MAX_MULTIPLE, max(lo, round(self.piece * f))))

    def _advance(self, slots: list[Slot]) -> bool:
        """Move every active slot by one step: a shared round for the decoding slots when two or more
        are, else their own rounds; one prefill piece for each prefilling slot, or, beside decoding
        slots with pieces on, for the shortest prompt only (module docstring). True when a prefill
        piece ran beside decoding slots (the round the adaptive piece measures)."""
        decoding = [s for s in slots if s.decoding]
        prefilling = [s for s in slots if not s.decoding]
        piece = self.piece if decoding else 0  # smaller pieces only while others wait on tokens
        if piece and len(prefilling) > 1:  # the least prefill left first; the rest resume next round
            first = min(prefilling, key=lambda s: (_prefill_left(s), s.index))
            slots = [s for s in slots if s.decoding or s is first]
            prefilling = [first]
        for slot in slots:
            if slot.pace is not None:
                slot.pace.shared = False
                slot.pace.prefill_chunk = piece or None
                slot.pace.halving = self._halving
        if self._shares and len(decoding) >= 2:
            own = self.policy.plan([s.solo for s in decoding])
            sharing = [s for s, o in zip(decoding, own) if not o]
            if sharing:
                warm = all(s.decode_steps for s in sharing)  # no first decode step (its one-off work) inside
                t0 = self._clock()
                lanes = self._shared_round(sharing)
                took = self._clock() - t0
                self.seconds["shared"] += took
                if warm:
                    self.policy.observe_shared(lanes, took)
            turns = [s for s, o in zip(decoding, own) if o]
            self.solo_turns += len(turns)
            slots = turns + prefilling
        for slot in slots:
            if self._slots[slot.index] is not slot:  # ended earlier in this round
                continue
            if slot.decoding:  # its own round: measured for the policy (not its first decode step)
                warm = slot.decode_steps > 0
                slot.decode_steps += 1
                t0 = self._clock()
                chunk = self._step(slot)
                took = self._clock() - t0
                self.seconds["solo"] += took
                if warm and chunk is not None and chunk.token_ids and chunk.finish_reason is None:
                    self.policy.observe_solo(slot.solo, len(chunk.token_ids), took)
            else:
                t0 = self._clock()
                self._step(slot)
                self.seconds["prefill"] += self._clock() - t0
        return bool(piece and prefilling)

    def _shared_round(self, slots: list[Slot]) -> int:
        """One weight sweep for every sharing slot: collect a lane group from each (after one batch of
        their MTP chains where the engine batches drafting), run them together, then let each finish
        its round (picks already made from its own rows; commit done, stop check, tokens). Returns the
        groups that ran (0 when none did)."""
        lanes: list[tuple[Slot, object]] = []
        drafting: list[tuple[Slot, object]] = []
        # each group's lanes: the sweep's flat width shared out by what each slot's drafters would use
        # (Pace.want_lanes; unknown: an even share), water-filled (share_policy.share_lanes)
        even = max(1, self.sweep_lanes // len(slots)) if self.sweep_lanes else 1
        shares = (share_lanes(self.sweep_lanes, [s.pace.want_lanes or even for s in slots]) if self.sweep_lanes
                  else [1] * len(slots))
        share = {slot.index: n for slot, n in zip(slots, shares)}
        for slot in slots:
            if self._slots[slot.index] is not slot:
                continue
            cancelled = slot.job.request.cancel.is_set()
            chunk = self._resume_shared(slot, share[slot.index])
            slot.decode_steps += 1
            if chunk is None:
                continue  # the engine failed: delivered and freed
            if chunk.draft is not None and not cancelled:
                drafting.append((slot, chunk.draft))
            else:
                self._take_lane(slot, chunk, cancelled, lanes)
        if drafting:
            # every sharing slot's MTP chain in one batch (engine.run_drafts keeps failures per chain),
            # then each slot is resumed to hand out its group
            t0 = self._clock()
            try:
                self.engine.run_drafts([call for _, call in drafting])
            except Exception as exc:
                log.exception("engine failed drafting a shared round")
                for slot, _ in drafting:
                    self._fail(slot, exc)
                drafting = []
            self.seconds["drafts"] += self._clock() - t0
            for slot, _ in drafting:
                chunk = self._resume_shared(slot, share[slot.index])
                if chunk is not None:
                    self._take_lane(slot, chunk, False, lanes)
        if not lanes:
            return 0
        t0 = self._clock()
        try:
            self.engine.run_lanes([lane for _, lane in lanes])
        except Exception as exc:  # run_lanes keeps failures per lane; anything else ends every lane's slot
            log.exception("engine failed in a shared round")
            for slot, _ in lanes:
                self._fail(slot, exc)
            return 0
        finally:
            self.seconds["sweep"] += self._clock() - t0
        if len(lanes) >= 2:
            self.batched_rounds += 1
            self.batched_lanes += len(lanes)
        for slot, _ in lanes:
            # the rest of its round: its tokens (or the error its lane met). The round began before any
            # cancel that lands now: the engine sees that flag at its next step, as after a solo round.
            chunk = self._step(slot, cancelled=False)
            if chunk is not None and chunk.token_ids and chunk.finish_reason is None:
                self.policy.observe_shared_tokens(slot.solo, len(chunk.token_ids))
        return len(lanes)

    def _resume_shared(self, slot: Slot, lanes: int):
        """Resume a sharing slot with the shared pace (its group's lanes, batched drafting)."""
        slot.pace.shared, slot.pace.lanes, slot.pace.batch_drafts = True, lanes, self.batch_drafts
        try:
            return self._resume(slot)
        finally:
            slot.pace.shared, slot.pace.lanes, slot.pace.batch_drafts = False, 1, False

    def _take_lane(self, slot: Slot, chunk: GenerationChunk, cancelled: bool, lanes: list) -> None:
        """A sharing slot's resume: its lane group joins the sweep, or the slot ends here."""
        if chunk.lane is not None and not cancelled:
            lanes.append((slot, chunk.lane))
        elif chunk.lane is not None or chunk.draft is not None:  # despite the cancel flag: end it, unrun
            self._settle(slot, GenerationChunk([]), cancelled)
        else:  # it ended (stop, length, cancel) or ran a round of its own (a stepper that ignores pace)
            self._settle(slot, chunk, cancelled)

    # ---- parts of a round -------------------------------------------------

    def _busy(self) -> bool:
        return bool(self._queue) or any(s is not None for s in self._slots)

    def _active(self) -> list[Slot]:
        with self._cond:
            return [s for s in self._slots if s is not None]

    def _drop_cancelled_queued(self) -> None:
        with self._cond:
            gone = [job for job in self._queue if job.request.cancel.is_set()]
            if not gone:
                return
            self._queue = deque(job for job in self._queue if not job.request.cancel.is_set())
        for job in gone:
            job.deliver(GenerationChunk(token_ids=[], finish_reason="cancelled"))
        self._changed()

    def _admit(self) -> None:
        admitted = False
        while True:
            with self._cond:
                free = next((i for i, s in enumerate(self._slots) if s is None), None)
                if free is None or not self._queue:
                    break
                job = self._queue.popleft()
            if job.request.cancel.is_set():  # left between the sweep and now
                job.deliver(GenerationChunk(token_ids=[], finish_reason="cancelled"))
                continue
            tap = self._open_tap(job) if self._open_tap is not None else None
            pace = Pace() if self._paced else None
            try:
                steps = iter(self._stepper(job.request, pace) if self._paced else self._stepper(job.request))
            except Exception as exc:  # refused before it started (a generate() that is not a generator)
                log.exception("engine failed on a request")
                if tap is not None:
                    tap.close("error")
                job.deliver(exc)
                continue
            with self._cond:
                self._slots[free] = Slot(free, job, steps, tap, len(job.request.prompt_ids), pace=pace)
            admitted = True
        if admitted:
            self._changed()

    def _step(self, slot: Slot, cancelled: bool | None = None) -> GenerationChunk | None:
        """One resume of the slot's stepper; delivers what it produced; frees the slot at its end.
        Returns the chunk (None when the step failed)."""
        if cancelled is None:
            cancelled = slot.job.request.cancel.is_set()  # set before this step: the engine must end now
        chunk = self._resume(slot)
        if chunk is None:
            return None
        if chunk.lane is not None or chunk.draft is not None:  # outside a shared round: the pace protocol broken
            self._fail(slot, RuntimeError("the engine handed out a decode lane in a round that is not shared"))
            return None
        self._settle(slot, chunk, cancelled)
        return chunk

    def _resume(self, slot: Slot) -> GenerationChunk | None:
        """next() of the slot's stepper; None when it raised (the error is delivered, the slot freed)."""
        request = slot.job.request
        try:
            chunk = next(slot.steps)
        except StopIteration:  # an engine that just stops iterating: tell the consumer why
            chunk = GenerationChunk([], finish_reason="cancelled" if request.cancel.is_set() else "stop")
        except Exception as exc:
            log.exception("engine failed on a request")
            self._fail(slot, exc)
            return None
        slot.rounds += 1
        return chunk

    def _fail(self, slot: Slot, exc: BaseException) -> None:
        if slot.tap is not None:
            slot.tap.close("error")
        slot.job.deliver(exc)
        self._free(slot)

    def _settle(self, slot: Slot, chunk: GenerationChunk, cancelled: bool) -> None:
        """Deliver a step's chunk; `cancelled`: the flag was set before the step (it must have ended)."""
        if chunk.token_ids:
            slot.decoding = True
            with self._cond:
                slot.tokens += len(chunk.token_ids)
        if chunk.finish_reason is None and cancelled:
            # the engine did not honour the flag within a step: end it here
            if chunk.token_ids:
                self._pass(slot, chunk)
            chunk = GenerationChunk([], finish_reason="cancelled")
        if chunk.token_ids or chunk.finish_reason is not None or chunk.logprobs:
            self._pass(slot, chunk)  # empty progress chunks (a prefill piece ran) stay here
        if chunk.finish_reason is not None:
            self._free(slot)

    def _pass(self, slot: Slot, chunk: GenerationChunk) -> None:
        if slot.tap is not None:
            slot.tap.chunk(chunk)
            if chunk.finish_reason is not None:
                slot.tap.close(chunk.finish_reason)  # recorded before the client can see the end
        slot.job.deliver(chunk)

    def _free(self, slot: Slot) -> None:
        with self._cond:
            if self._slots[slot.index] is slot:
                self._slots[slot.index] = None
        try:
            close = getattr(slot.steps, "close", None)
            if close is not None:
                close()  # a real engine has released its sequence already; this ends the generator
        except Exception:
            log.exception("engine failed while ending a request")
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()
