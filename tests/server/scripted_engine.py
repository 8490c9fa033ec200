"""A test-only next-token source implementing the Engine protocol.

The tiny model cannot be made to call tools reliably, so server and client
tests drive the model side with a script: a function from the decoded prompt
text to the text the "model" says next. The text is encoded with the real
tokenizer (markers such as </think> and <tool_call> become their special
tokens, as a real model emits them) and streamed back a few tokens per chunk,
so the real text stage (detokenizer, splitter), tool parser and SSE paths all run.

It lives under tests/ only: the package has no way to serve it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from q27py.engine.api import GenerationChunk, GenerationRequest


@dataclass
class ScriptedEngine:
    tokenizer: object
    script: Callable[[str], str]
    stop_ids: frozenset[int]
    max_context: int = 8192
    tokens_per_chunk: int = 2
    prefill_delay_s: float = 0.0  # simulates a long prefill (keep-alive tests)
    token_delay_s: float = 0.0
    cached_tokens: int | Callable[[GenerationRequest, int], int] = 0  # or (request, index) -> count
    requests: list[GenerationRequest] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    max_slots: int = 1  # requests the bridge's scheduler interleaves (engine/scheduler.py)
    model_name: str = "scripted-tiny"
    model_dir: Path = Path("/nonexistent")  # no template files: the default template

    def prefix_stats(self):
        return None

    def kv_cache_usage(self):
        return None

    def generate(self, request: GenerationRequest):
        self.requests.append(request)
        prompt = self.tokenizer.decode(request.prompt_ids)
        self.prompts.append(prompt)
        ids = self.tokenizer.encode(self.script(prompt)) + [min(self.stop_ids)]
        if not self._wait(self.prefill_delay_s, request):
            yield self._final(request, [], "cancelled")
            return
        produced: list[int] = []
        while produced != ids:
            if request.cancel.is_set():
                self.cancelled.set()
                yield self._final(request, produced, "cancelled")
                return
            room = request.max_tokens - len(produced)
            if room <= 0:
                yield self._final(request, produced, "length")
                return
            step = ids[len(produced): len(produced) + min(self.tokens_per_chunk, room)]
            eos = [t for t in step if t in request.stop_ids]
            if eos:
                step = step[: step.index(eos[0]) + 1]
            produced += step
            yield GenerationChunk(token_ids=step)
            if eos:
                yield self._final(request, produced, "stop")
                return
            if not self._wait(self.token_delay_s, request):
                continue
        yield self._final(request, produced, "stop")

    def _wait(self, seconds: float, request: GenerationRequest) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if request.cancel.wait(0.01):
                self.cancelled.set()
                return False
        return True

    def _final(self, request, produced, reason) -> GenerationChunk:
        cached = self.cached_tokens
        if callable(cached):
            cached = cached(request, len(self.requests) - 1)
        return GenerationChunk(token_ids=[], finish_reason=reason, stats={
            "prompt_tokens": len(request.prompt_ids), "cached_tokens": cached,
            "generated_tokens": len(produced)})
