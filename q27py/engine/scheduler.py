"""Continuous batching on one model: slots, a FIFO queue, and rounds (issue 15).

A slot is one request in flight: the engine's resumable stepper for it (LocalEngine.steps:
each resume runs one bounded unit, a prefill chunk or a decode round, and returns its
chunk) plus the request's bookkeeping. The engine thread calls `round()` over and over:

1. queued requests whose client left are answered "cancelled" without ever starting;
2. slots whose request was cancelled are stepped once: the engine notices the flag at
   its next check and ends at once (no model work), so the slot is free before anything
   else in the round runs; an engine that does not end then is closed here;
3. free slots admit queued requests in arrival order (FIFO);
4. every active slot advances by exactly one step (round-robin in slot order).

So a running stream waits at most one round between two of its steps, and a round costs
one step per slot: one decode round each, or one prefill chunk (engine_prefill_chunk; the
CPU path's cpu_prefill_chunk) for a slot still prefilling. A long prompt therefore delays
running streams by one chunk per round, and a short request admitted after a long
generation finishes after about as many rounds as it has tokens.

Nothing here knows about the model, trio or HTTP: jobs are anything with a `request`, a
`submitted` time and a `deliver(item)` (the bridge's, server/bridge.py), so the whole
policy is tested synchronously, round by round (tests/engine/test_scheduler.py).

Determinism: each slot's stepper runs its own forwards on its own state, whole, one at a
time; nothing a slot computes depends on the others, so its greedy output is bitwise the
same alone or mixed (tested on the CPU paths).

Where the batched weight sweep comes in (the GPU work of issue 15.2): `_advance` is the
one place that moves the active slots through a round. Today it steps them in turn; the
batched version collects every slot's lanes for the round (its pending token plus drafts:
SpecDecoder._round's plan half), runs one forward over all of them, and hands each slot
its rows to accept and commit (the other half). The admission, cancellation and queueing
policy around it stays as it is.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

from q27py.engine.api import GenerationChunk, GenerationRequest

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


def engine_slots(engine) -> int:
    """Requests an engine can interleave: its max_slots (an engine without one runs one at a time)."""
    return max(1, int(getattr(engine, "max_slots", 1) or 1))


class Scheduler:
    """The slots and the queue. submit/stop/counts from any thread; wait/round from the engine thread."""

    def __init__(self, engine, max_slots: int | None = None,
                 open_tap: Callable[[Job], object | None] | None = None,
                 on_change: Callable[[], None] | None = None):
        self.engine = engine
        self.max_slots = max(1, int(max_slots)) if max_slots is not None else engine_slots(engine)
        # LocalEngine.steps yields after every bounded unit; an engine with generate() only
        # (scripted test engines) is stepped chunk by chunk.
        self._stepper = getattr(engine, "steps", None) or engine.generate
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
        self._advance(active)
        return len(active)

    def _advance(self, slots: list[Slot]) -> None:
        """Move every active slot by one step: the seam for the batched weight sweep (module docstring)."""
        for slot in slots:
            if self._slots[slot.index] is slot:  # not ended earlier in this round
                self._step(slot)

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
            try:
                steps = iter(self._stepper(job.request))
            except Exception as exc:  # refused before it started (a generate() that is not a generator)
                log.exception("engine failed on a request")
                if tap is not None:
                    tap.close("error")
                job.deliver(exc)
                continue
            with self._cond:
                self._slots[free] = Slot(free, job, steps, tap, len(job.request.prompt_ids))
            admitted = True
        if admitted:
            self._changed()

    def _step(self, slot: Slot) -> None:
        """One resume of the slot's stepper; delivers what it produced; frees the slot at its end."""
        request = slot.job.request
        cancelled = request.cancel.is_set()  # set before this step: the engine must end now
        try:
            chunk = next(slot.steps)
        except StopIteration:  # an engine that just stops iterating: tell the consumer why
            chunk = GenerationChunk([], finish_reason="cancelled" if request.cancel.is_set() else "stop")
        except Exception as exc:
            log.exception("engine failed on a request")
            if slot.tap is not None:
                slot.tap.close("error")
            slot.job.deliver(exc)
            self._free(slot)
            return
        slot.rounds += 1
        if chunk.token_ids:
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
