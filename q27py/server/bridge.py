"""The engine runs in its own thread; trio tasks submit requests and await chunks.

The engine is synchronous and single-threaded, so one thread pulls requests
from a FIFO and runs them one at a time. Chunks travel back to the event loop
with `TrioToken.run_sync_soon` (never blocking the engine thread) into an
unbounded per-request channel. A consumer that leaves for any reason (client
disconnect, error, shutdown) sets `request.cancel`: a queued request is then
skipped, a running one stops at the engine's next check.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

import trio

from q27py.engine.api import Engine, GenerationChunk, GenerationRequest
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


_STOP = object()


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
    def __init__(self, engine: Engine):
        self.engine = engine
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running: GenerationRequest | None = None
        self._running_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="q27py-engine", daemon=True)
        self._started = False
        # Set by the App to its Metrics: timing taps per generation and load samples (server/metrics.py).
        self.observer = None

    @property
    def max_context(self) -> int:
        return int(self.engine.max_context)

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel everything queued or running and end the thread."""
        with self._lock:
            if self._running is not None:
                self._running.cancel.set()
        self._jobs.put(_STOP)
        if self._started:
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest) -> Generation:
        """Queue a request; must be called from inside trio."""
        send, receive = trio.open_memory_channel(math.inf)
        job = _Job(request, trio.lowlevel.current_trio_token(), send)
        with self._lock:
            self._waiting += 1
        self._jobs.put(job)
        self._sample()
        return Generation(request, receive)

    def load(self) -> EngineLoad:
        with self._lock:
            running = 1 if self._running is not None else 0
            tokens = self._running_tokens
            waiting = self._waiting
        fraction = self.engine.kv_cache_usage()
        if fraction is None:  # one sequence at a time: its length over the context window
            fraction = min(1.0, tokens / max(1, self.max_context))
        prefix = self.engine.prefix_stats()
        prefix = dict(prefix) if prefix is not None else None
        slots = (prefix or {}).get("max_sequences")
        return EngineLoad(running=running, waiting=waiting, kv_cache_usage=float(fraction), prefix=prefix,
                          slots_total=int(slots) if slots is not None else None)

    def _sample(self) -> None:
        if self.observer is not None:
            self.observer.sample_load(self.load())

    # ---- the engine thread ---------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            request = job.request
            with self._lock:
                self._waiting -= 1
                if request.cancel.is_set():
                    skipped = True
                else:
                    skipped = False
                    self._running = request
                    self._running_tokens = len(request.prompt_ids)
            if skipped:
                job.deliver(GenerationChunk(token_ids=[], finish_reason="cancelled"))
                continue
            tap = self.observer.tap(job.submitted, len(request.prompt_ids)) if self.observer else None
            self._sample()
            try:
                finished = False
                for chunk in self.engine.generate(request):
                    with self._lock:
                        self._running_tokens += len(chunk.token_ids)
                    if tap is not None:
                        tap.chunk(chunk)
                        if chunk.finish_reason is not None:
                            tap.close()  # recorded before the client can see the end and read /metrics
                    job.deliver(chunk)
                    if chunk.finish_reason is not None:
                        finished = True
                        break
                if not finished:  # an engine that just stops iterating: tell the consumer why
                    reason = "cancelled" if request.cancel.is_set() else "stop"
                    if tap is not None:
                        tap.close(reason)
                    job.deliver(GenerationChunk(token_ids=[], finish_reason=reason))
            except Exception as exc:
                log.exception("engine failed on a request")
                job.deliver(exc)
            finally:
                with self._lock:
                    self._running = None
                    self._running_tokens = 0
                if tap is not None:
                    tap.close("error")  # no-op unless the engine raised
                self._sample()
