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
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF/vLLM: over prompt + output (1 = off)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class OutputConstraint:
    """What the output must be (compiled by the engine: engine/grammar.py, engine/constraint.py).

    kind: "json_object" (any JSON object), "json_schema" (schema), "tool_calls" (the Qwen XML
    call syntax for `tools`: {name: parameters schema}; `names` limits which may be called,
    max_calls bounds how many). after_think: the prompt leaves a think block open, which stays
    free-form; the constraint starts after `</think>`."""

    kind: str
    schema: dict | None = None
    tools: dict | None = None
    names: tuple[str, ...] = ()
    max_calls: int | None = None
    after_think: bool = False
    dialect: str = "xml"  # tool_calls: the checkpoint's call syntax (chat/render.py choose_dialect)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()  # EOS ids: generation ends on them (not emitted as text)
    stop_strings: tuple[str, ...] = ()  # text stops: output is cut before the first match
    stable_len: int | None = None  # prompt tokens up to the renderer's stable boundary (prefix reuse)
    cancel: threading.Event = field(default_factory=threading.Event)
    constraint: OutputConstraint | None = None
    logprobs: int | None = None  # None: off; n >= 0: each token's logprob and the n most likely


@dataclass
class GenerationChunk:
    """One step of output: new token ids (possibly several per speculative round)."""

    token_ids: list[int]
    text: str = ""  # detokenized text of token_ids, UTF-8-safe across chunk boundaries
    finish_reason: str | None = None  # None while running; then "stop" | "length" | "stop_string" | "cancelled"
    stats: dict | None = None  # on the final chunk: prompt_tokens, cached_tokens, generated_tokens, rounds, ...
    logprobs: list | None = None  # when asked: one engine.sampling.TokenLogprob per token id


class Engine(Protocol):
    """What the server needs from an engine. Calls come from one engine thread."""

    max_context: int  # prompt + generated tokens per sequence

    def generate(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """Run one request to completion, yielding chunks; honour request.cancel promptly."""
        ...
