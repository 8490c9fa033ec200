"""One assistant turn: prompt ids -> engine -> text stage -> events, API-neutral.

The API modules consume the same event stream, so text, reasoning, tool
calls, stop sequences, the reasoning budget and usage behave identically on
every API, streaming or not:

- the text stage's events (TextDelta, ReasoningDelta, ToolCallStart,
  ToolCallArgsDelta, ToolCallEnd from q27py.chat.stream; chat/textstage.py
  detokenizes, splits and applies stop sequences);
- KEEPALIVE when the engine has produced nothing for `ping_interval_s`
  (long prefill or a queue): emitters turn it into their API's ping;
- a final `Finish` with the reason and the usage.

Reasoning budget: when the model has spent `reasoning_budget` tokens inside a
think block the prompt opened, the generation is stopped, a close
("\n</think>\n\n") is appended, and a continuation request resumes from prompt
+ generated + close, so the model still answers within max_tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

import trio

from q27py.chat.textstage import FORCED_THINK_CLOSE, RawSplitter, TextStage
from q27py.engine.api import GenerationRequest, OutputConstraint, SamplingParams
from q27py.server.bridge import EngineBridge, Generation
from q27py.server.control import content_logprobs

log = logging.getLogger("q27py.server")

KEEPALIVE = object()


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Finish:
    # "stop" (end of turn) | "tool_calls" | "length" | "stop_sequence" | "cancelled" | "error"
    reason: str
    usage: Usage
    stop_sequence: str | None = None
    reasoning_budget_exceeded: bool = False
    error: str | None = None  # for reason == "error": a message safe to show the client


@dataclass
class TurnPlan:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: frozenset[int] = frozenset()
    stop_sequences: tuple[str, ...] = ()
    stable_len: int | None = None
    system_len: int | None = None
    starts_in_reasoning: bool = False  # the prompt ends inside an open <think>
    reasoning_budget: int | None = None  # tokens; None = unlimited
    stop_after_tool_call: bool = False  # parallel tool calls disabled: end the turn after the first call
    make_splitter: Callable[[bool], object] | None = None  # in_reasoning -> splitter; None = raw text
    constraint: OutputConstraint | None = None  # grammar the output must follow (server/control.py)
    logprobs: int | None = None  # None: off; n: each token's logprob and the n most likely


@dataclass
class Logprobs:
    """Log probabilities of the tokens of one engine chunk, in order (server/control.py
    content_logprobs entries), yielded after that chunk's text events."""

    entries: list


async def run_turn(bridge: EngineBridge, tokenizer, plan: TurnPlan, *,
                   ping_interval_s: float = 10.0) -> AsyncIterator[object]:
    """Yield text-stage events, KEEPALIVE ticks and, last, one Finish. Cancels the engine on exit."""
    make_splitter = plan.make_splitter or RawSplitter
    stage = TextStage(tokenizer, make_splitter(plan.starts_in_reasoning), stop_ids=plan.stop_ids,
                      stops=plan.stop_sequences, stop_after_tool_call=plan.stop_after_tool_call,
                      reasoning_budget=plan.reasoning_budget if plan.starts_in_reasoning else None)
    usage = Usage(prompt_tokens=len(plan.prompt_ids))
    budget_exceeded = False

    def submit(prompt_ids: list[int], max_tokens: int, think_closed: bool = False) -> Generation:
        constraint = plan.constraint
        if constraint is not None and think_closed:
            constraint = replace(constraint, after_think=False)  # the close is in the prompt now
        return bridge.submit(GenerationRequest(
            prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=plan.sampling,
            stop_ids=plan.stop_ids, stable_len=plan.stable_len, system_len=plan.system_len,
            constraint=constraint, logprobs=plan.logprobs))

    generation = submit(list(plan.prompt_ids), plan.max_tokens)
    engine_reason: str | None = None
    try:
        while engine_reason is None and not stage.stopped:
            chunk = None
            with trio.move_on_after(ping_interval_s):
                chunk = await generation.next_chunk()
            if chunk is None:
                yield KEEPALIVE
                continue
            stats = chunk.stats or {}
            if "cached_tokens" in stats and not budget_exceeded:
                # Usage describes the request as the client sent it: only the first
                # generation's cache reuse counts (a continuation after the forced think
                # close reuses the turn's own prompt + reasoning, which the client never sent).
                usage.cached_tokens = max(0, min(int(stats["cached_tokens"]), usage.prompt_tokens))
            for ev in stage.feed(chunk.token_ids):
                yield ev
            if chunk.logprobs:
                yield Logprobs(content_logprobs(chunk.logprobs, tokenizer))
            if stage.stopped:
                break
            if stage.budget_hit:
                # Budget spent inside <think>: close it ourselves and let the model answer.
                budget_exceeded = True
                generation.cancel()
                generation.close()
                budget = stage.reasoning_budget
                if stage.completion_tokens + len(tokenizer.encode(FORCED_THINK_CLOSE)) >= plan.max_tokens:
                    # No room for the close and an answer: max_tokens is a hard limit, so the
                    # turn ends here, at length, rather than overrunning with forced tokens.
                    engine_reason = "length"
                    break
                for ev in stage.close_think():
                    yield ev
                remaining = plan.max_tokens - stage.completion_tokens
                log.info("reasoning budget of %d tokens spent; think block closed, %d tokens left",
                         budget, remaining)
                if stage.stopped:
                    break
                if remaining <= 0:
                    engine_reason = "length"
                    break
                generation = submit(list(plan.prompt_ids) + stage.generated, remaining, think_closed=True)
                continue
            engine_reason = chunk.finish_reason
            if engine_reason == "cancelled":
                break

        if engine_reason != "cancelled":
            for ev in stage.finish():
                yield ev

        usage.completion_tokens = stage.completion_tokens
        usage.reasoning_tokens = stage.reasoning_tokens
        if stage.matched_stop is not None:
            reason = "stop_sequence"
        elif engine_reason == "cancelled":
            reason = "cancelled"
        elif engine_reason == "length":
            reason = "length"
        elif stage.tool_calls_done:
            reason = "tool_calls"
        else:
            reason = "stop"
        yield Finish(reason=reason, usage=usage, stop_sequence=stage.matched_stop,
                     reasoning_budget_exceeded=budget_exceeded)
    finally:
        generation.cancel()
        generation.close()
