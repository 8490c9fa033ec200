"""The narrow boundary between the server (or the CLI) and the engine.

The caller hands the engine token ids + sampling settings + a cancel handle and
receives token ids (plus statistics); it never sees tensors and never text:
detokenizing, stop strings and the think / tool-call split are the text stage's
job (q27py/chat/textstage.py), the same for the server and `q27py generate`.
Everything here is plain data so the server can be tested against any object
with this shape (tests drive it with a scripted engine).

The context-limit rule lives here, once: a prompt may use the window except
OUTPUT_RESERVE tokens, and the answer gets what the prompt leaves.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

from q27py.errors import Q27Error

# Tokens a prompt must leave free: room to answer at all, plus a forced think close.
OUTPUT_RESERVE = 16


class ContextLengthError(Q27Error):
    def __init__(self, prompt_tokens: int, max_context: int):
        super().__init__(f"prompt is too long: {prompt_tokens} tokens > {max_context} maximum")
        self.prompt_tokens = prompt_tokens
        self.max_context = max_context


def max_prompt_tokens(max_context: int) -> int:
    """The longest prompt a context window of max_context tokens accepts."""
    return max(1, max_context - OUTPUT_RESERVE)


def check_prompt(prompt_tokens: int, max_context: int) -> None:
    """Raise ContextLengthError (limit = max_prompt_tokens) if the prompt does not fit."""
    limit = max_prompt_tokens(max_context)
    if prompt_tokens > limit:
        raise ContextLengthError(prompt_tokens, limit)


def clamp_max_tokens(requested: int, prompt_tokens: int, max_context: int) -> int:
    """The answer's token limit: what was asked for, at most what the window has left."""
    return max(0, min(requested, max_context - prompt_tokens))


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
    stop_ids: frozenset[int] = frozenset()  # EOS ids: generation ends on them (emitted as the last token)
    stable_len: int | None = None  # prompt tokens up to the renderer's stable boundary (prefix reuse)
    system_len: int | None = None  # prompt tokens of a leading shared system block (prefix reuse)
    cancel: threading.Event = field(default_factory=threading.Event)
    constraint: OutputConstraint | None = None
    logprobs: int | None = None  # None: off; n >= 0: each token's logprob and the n most likely


@dataclass
class GenerationChunk:
    """One step of output: new token ids (possibly several per speculative round)."""

    token_ids: list[int]
    finish_reason: str | None = None  # None while running; then "stop" | "length" | "cancelled"
    stats: dict | None = None  # on the final chunk: prompt_tokens, cached_tokens, generated_tokens, rounds, ...
    logprobs: list | None = None  # when asked: one engine.sampling.TokenLogprob per token id
    # Engine-internal, between LocalEngine.steps and the scheduler only (never delivered): a decode
    # lane waiting for the round's shared forward (engine/decoder.py Lane; engine/scheduler.py).
    lane: object | None = None
    # ... and a ladder's MTP chain waiting for the round's batched drafting (engine/spec.py DraftCall)
    draft: object | None = None


class Engine(Protocol):
    """What the server needs from an engine. Calls to generate come from one engine thread."""

    max_context: int  # prompt + generated tokens per sequence
    model_name: str  # the name the server reports
    model_dir: Path  # where the tokenizer and chat template files are
    tokenizer: object  # encode / decode / new_decoder / eos_ids / special_ids

    def generate(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """Run one request to completion, yielding chunks; honour request.cancel promptly."""
        ...

    def prefix_stats(self) -> dict | None:
        """Prefix-cache counters for /metrics (None: the engine has no prefix cache)."""
        ...

    def kv_cache_usage(self) -> float | None:
        """Fraction of KV memory in use (None: the bridge estimates it from the running sequence)."""
        ...
