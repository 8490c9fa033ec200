"""The engine runs in its own thread; trio tasks submit requests and await chunks.

The engine is synchronous and single-threaded, so one thread drives the
scheduler (engine/scheduler.py): requests queue FIFO, up to the engine's
max_slots of them run at once, interleaved round by round. Chunks travel back to
the event loop with `TrioToken.run_sync_soon` (never blocking the engine thread)
into an unbounded per-request channel. A consumer that leaves for any reason
(client disconnect, error, shutdown) sets `request.cancel`: a queued request is
then answered without running, a running one ends at the start of the next round
and its slot takes the next queued request.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field

import trio

from q27py.engine.api import Engine, GenerationChunk, GenerationRequest
from q27py.engine.scheduler import Scheduler
from q27py.server.metrics import EngineLoad

log = logging.getLogger("q27py.server")


class EngineFailure(Exception):
    """The engine raised while generating; the message is for the log, not the client."""


@dataclass
class _Job:
    request: GenerationRequest
    token: trio.lowlevel.TrioToken
    send: trio.MemorySendChannel
    submitted: float = field(default_factory=time.monotonic)

    def deliver(self, item) -> None:
        def put() -> None:
            try:
                self.send.send_nowait(item)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.request.cancel.set()  # nobody is listening any more

        try:
            self.token.run_sync_soon(put)
        except trio.RunFinishedError:
            self.request.cancel.set()


class Generation:
    """The trio side of one submitted request."""

    def __init__(self, request: GenerationRequest, receive: trio.MemoryReceiveChannel):
        self.request = request
        self._receive = receive
        self.finished = False

    async def next_chunk(self) -> GenerationChunk:
        """The next chunk; the last one carries finish_reason. Raises EngineFailure if the engine did."""
        item = await self._receive.receive()
        if isinstance(item, BaseException):
            self.finished = True
            raise EngineFailure(f"{type(item).__name__}: {item}") from item
        if item.finish_reason is not None:
            self.finished = True
        return item

    def cancel(self) -> None:
        self.request.cancel.set()

    def close(self) -> None:
        """Stop listening: later chunks are dropped and the engine is told to stop."""
        self.request.cancel.set()
        self._receive.close()


class EngineBridge:
    def __init__(self, engine: Engine, max_slots: int | None = None):
        self.engine = engine
        # Set by the App to its Metrics: timing taps per generation and load samples (server/metrics.py).
        self.observer = None
        self._sched = Scheduler(engine, max_slots, open_tap=self._open_tap, on_change=self._sample)
        self._thread = threading.Thread(target=self._loop, name="q27py-engine", daemon=True)
        self._started = False

    @property
    def max_context(self) -> int:
        return int(self.engine.max_context)

    @property
    def max_slots(self) -> int:
        return self._sched.max_slots

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel everything queued or running and end the thread."""
        self._sched.stop()
        if self._started:
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest) -> Generation:
        """Queue a request; must be called from inside trio."""
        send, receive = trio.open_memory_channel(math.inf)
        self._sched.submit(_Job(request, trio.lowlevel.current_trio_token(), send))
        self._sample()
        return Generation(request, receive)

    def load(self) -> EngineLoad:
        running, waiting, tokens = self._sched.counts()
        fraction = self.engine.kv_cache_usage()
        if fraction is None:  # the running sequences' lengths over what the slots can hold
            fraction = min(1.0, tokens / max(1, self.max_slots * self.max_context))
        prefix = self.engine.prefix_stats()
        prefix = dict(prefix) if prefix is not None else None
        slots = (prefix or {}).get("max_sequences")
        return EngineLoad(running=running, waiting=waiting, kv_cache_usage=float(fraction), prefix=prefix,
                          slots_total=int(slots) if slots is not None else None, max_running=self.max_slots)

    def _sample(self) -> None:
        if self.observer is not None:
            self.observer.sample_load(self.load())

    def _open_tap(self, job: _Job):
        return self.observer.tap(job.submitted, len(job.request.prompt_ids)) if self.observer else None

    # ---- the engine thread ---------------------------------------------

    def _loop(self) -> None:
        while self._sched.wait():
            self._sched.round()
