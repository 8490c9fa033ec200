"""One assistant turn: prompt ids -> engine -> decoded text -> splitter events, API-neutral.

The three API modules consume the same event stream, so text, reasoning, tool
calls, stop sequences, the reasoning budget and usage behave identically on
every API, streaming or not:

- the splitter's events (TextDelta, ReasoningDelta, ToolCallStart,
  ToolCallArgsDelta, ToolCallEnd from q27py.chat.stream);
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
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import trio

from q27py.chat import stream as chat_stream
from q27py.engine.api import GenerationRequest, SamplingParams
from q27py.server.bridge import EngineBridge, Generation
from q27py.server.stops import StopMatcher

log = logging.getLogger("q27py.server")

THINK_CLOSE_MARKER = "</think>"
FORCED_THINK_CLOSE = "\n</think>\n\n"

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
    starts_in_reasoning: bool = False  # the prompt ends inside an open <think>
    reasoning_budget: int | None = None  # tokens; None = unlimited
    stop_after_tool_call: bool = False  # parallel tool calls disabled: end the turn after the first call
    make_splitter: Callable[[bool], object] | None = None  # in_reasoning -> splitter; None = raw text


class RawSplitter:
    """/v1/completions: every byte is text; no reasoning or tool markup is interpreted."""

    def __init__(self, in_reasoning: bool = False):
        pass

    def feed(self, text: str) -> list:
        return [chat_stream.TextDelta(text)] if text else []

    def finish(self) -> list:
        return []


def _ends_reasoning(event) -> bool:
    # Visible text means the think block is over; a tool call is not enough (the
    # splitter lets reasoning continue after a call made inside <think>).
    return isinstance(event, chat_stream.TextDelta)


async def run_turn(bridge: EngineBridge, tokenizer, plan: TurnPlan, *,
                   ping_interval_s: float = 10.0) -> AsyncIterator[object]:
    """Yield splitter events, KEEPALIVE ticks and, last, one Finish. Cancels the engine on exit."""
    make_splitter = plan.make_splitter or RawSplitter
    splitter = make_splitter(plan.starts_in_reasoning)
    stops = StopMatcher(list(plan.stop_sequences))
    usage = Usage(prompt_tokens=len(plan.prompt_ids))
    in_reasoning = plan.starts_in_reasoning
    think_tail = ""
    generated: list[int] = []
    tool_calls_done = 0
    budget_exceeded = False
    budget = plan.reasoning_budget if plan.starts_in_reasoning else None

    def submit(prompt_ids: list[int], max_tokens: int) -> Generation:
        return bridge.submit(GenerationRequest(
            prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=plan.sampling,
            stop_ids=plan.stop_ids, stable_len=plan.stable_len))

    def route(events: list) -> tuple[list, bool]:
        """Apply stop sequences to visible text. Returns (events to emit, stopped)."""
        nonlocal in_reasoning, tool_calls_done
        out = []
        for ev in events:
            if _ends_reasoning(ev):
                in_reasoning = False
            if isinstance(ev, chat_stream.TextDelta):
                if stops.stops:
                    text = stops.feed(ev.text)
                    if text:
                        out.append(chat_stream.TextDelta(text))
                    if stops.matched is not None:
                        return out, True
                    continue
            elif stops.stops:
                held = stops.flush()  # text held as a possible stop prefix precedes this event
                if held:
                    out.append(chat_stream.TextDelta(held))
            out.append(ev)
            if isinstance(ev, chat_stream.ToolCallEnd):
                tool_calls_done += 1
                if plan.stop_after_tool_call:
                    return out, True
        return out, False

    generation = submit(list(plan.prompt_ids), plan.max_tokens)
    decoder = tokenizer.new_decoder()
    engine_reason: str | None = None
    stopped_early = False
    try:
        while engine_reason is None and not stopped_early:
            chunk = None
            with trio.move_on_after(ping_interval_s):
                chunk = await generation.next_chunk()
            if chunk is None:
                yield KEEPALIVE
                continue
            stats = chunk.stats or {}
            if "cached_tokens" in stats:
                usage.cached_tokens = int(stats["cached_tokens"])
            restart = False
            for token in chunk.token_ids:
                if token in plan.stop_ids:  # end of turn: counted (the model produced it), never shown
                    usage.completion_tokens += 1
                    continue
                if budget is not None and in_reasoning and usage.reasoning_tokens >= budget:
                    restart = True
                    break
                generated.append(token)
                usage.completion_tokens += 1
                if in_reasoning:
                    usage.reasoning_tokens += 1
                text = decoder.feed([token])
                if in_reasoning:
                    think_tail = (think_tail + text)[-32:]
                    if THINK_CLOSE_MARKER in think_tail:
                        in_reasoning = False
                events, stopped_early = route(splitter.feed(text))
                for ev in events:
                    yield ev
                if stopped_early:
                    break
            if stopped_early:
                break
            if restart:
                # Budget spent inside <think>: close it ourselves and let the model answer.
                budget_exceeded = True
                generation.cancel()
                generation.close()
                close_text = decoder.flush() + FORCED_THINK_CLOSE
                close_ids = tokenizer.encode(FORCED_THINK_CLOSE)
                generated.extend(close_ids)
                usage.completion_tokens += len(close_ids)
                in_reasoning = False
                events, stopped_early = route(splitter.feed(close_text))
                for ev in events:
                    yield ev
                remaining = plan.max_tokens - usage.completion_tokens
                log.info("reasoning budget of %d tokens spent; think block closed, %d tokens left",
                         budget, remaining)
                if stopped_early:
                    break
                if remaining <= 0:
                    engine_reason = "length"
                    break
                generation = submit(list(plan.prompt_ids) + generated, remaining)
                decoder = tokenizer.new_decoder()
                continue
            engine_reason = chunk.finish_reason
            if engine_reason == "cancelled":
                break

        if not stopped_early and engine_reason != "cancelled":
            tail_events = splitter.feed(decoder.flush()) + splitter.finish()
            events, stopped_early = route(tail_events)
            for ev in events:
                yield ev
            if not stopped_early and stops.stops:
                held = stops.flush()
                if held:
                    yield chat_stream.TextDelta(held)

        if stops.matched is not None:
            reason = "stop_sequence"
        elif engine_reason == "cancelled":
            reason = "cancelled"
        elif engine_reason == "length":
            reason = "length"
        elif tool_calls_done:
            reason = "tool_calls"
        elif engine_reason == "stop_string":
            reason = "stop_sequence"
        else:
            reason = "stop"
        yield Finish(reason=reason, usage=usage, stop_sequence=stops.matched,
                     reasoning_budget_exceeded=budget_exceeded)
    finally:
        generation.cancel()
        generation.close()
