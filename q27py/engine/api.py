"""The narrow boundary between the server and the engine.

The server hands the engine token ids + sampling settings + a cancel handle and
receives token ids (plus statistics); it never sees tensors. Everything here is
plain data so the server can be tested against any object with this shape
(tests drive it with a scripted engine).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator, Protocol


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()  # EOS ids: generation ends on them (not emitted as text)
    stop_strings: tuple[str, ...] = ()  # text stops: output is cut before the first match
    stable_len: int | None = None  # prompt tokens up to the renderer's stable boundary (prefix reuse)
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class GenerationChunk:
    """One step of output: new token ids (possibly several per speculative round)."""

    token_ids: list[int]
    text: str = ""  # detokenized text of token_ids, UTF-8-safe across chunk boundaries
    finish_reason: str | None = None  # None while running; then "stop" | "length" | "stop_string" | "cancelled"
    stats: dict | None = None  # on the final chunk: prompt_tokens, cached_tokens, generated_tokens, rounds, ...


class Engine(Protocol):
    """What the server needs from an engine. Calls come from one engine thread."""

    max_context: int  # prompt + generated tokens per sequence

    def generate(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """Run one request to completion, yielding chunks; honour request.cancel promptly."""
        ...
