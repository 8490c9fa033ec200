"""What the three chat APIs share: prompt building, context limits, thinking policy, turns.

API modules map their request into a Conversation (q27py.chat.requests),
then ask this service to render and tokenize it, check it against the
context window, and run the turn. Keeping these steps here means
count_tokens, /v1/messages, /v1/chat/completions and /v1/responses can never
disagree about how many tokens a conversation costs.
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from dataclasses import dataclass, field

from q27py.chat.conversation import Conversation
from q27py.chat.render import THINK_OPEN, RenderError, render
from q27py.config import ServerConfig
from q27py.engine.api import SamplingParams
from q27py.server import turn as turn_mod
from q27py.server.bridge import EngineBridge
from q27py.server.errors import ApiError
from q27py.server.metrics import Metrics
from q27py.server.turn import KEEPALIVE, Finish, TurnPlan, Usage

log = logging.getLogger("q27py.server")

# Tokens a prompt must leave free: room to answer at all, plus a forced think close.
OUTPUT_RESERVE = 16


@dataclass
class Prompt:
    ids: list[int]
    text: str
    stable_tokens: int | None  # prompt tokens up to the renderer's stable boundary
    starts_in_reasoning: bool  # the prompt ends inside an open <think>


@dataclass
class ToolCallResult:
    index: int
    name: str  # the name the model used
    arguments: str  # JSON text of the arguments object


@dataclass
class TurnResult:
    """A whole turn, for non-streaming responses."""

    reasoning: str = ""
    text: str = ""
    tool_calls: list[ToolCallResult] = field(default_factory=list)
    finish: Finish | None = None


class ChatService:
    def __init__(self, bridge: EngineBridge, tokenizer, *, model_name: str, template: str,
                 stop_ids, config: ServerConfig | None = None, metrics: Metrics | None = None,
                 ping_interval_s: float = 10.0):
        self.bridge = bridge
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.template = template
        self.stop_ids = frozenset(stop_ids)
        self.config = config or ServerConfig()
        self.metrics = metrics or Metrics(model_name)
        self.ping_interval_s = ping_interval_s

    @property
    def max_context(self) -> int:
        return self.bridge.max_context

    @property
    def max_prompt_tokens(self) -> int:
        return max(1, self.max_context - OUTPUT_RESERVE)

    # ---- prompts ---------------------------------------------------------

    def conversation(self, api: str, body: dict):
        """(Conversation, RequestOptions) for `api` ("anthropic" | "openai" | "responses"); 400 if unreadable."""
        from q27py.chat.requests import RequestError, parse_request

        try:
            conv, opts = parse_request(api, body)
        except RequestError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        if opts.tool_choice.mode == "none":
            conv.tools = []  # the model is not told about tools it may not call
        return conv, opts

    def render(self, conv: Conversation, *, thinking: bool | None,
               preserve_thinking: bool | None = None) -> Prompt:
        """Render and tokenize. thinking None -> the server default."""
        enable = self.config.default_thinking if thinking is None else thinking
        if preserve_thinking is None:
            preserve_thinking = self.config.preserve_thinking
        try:
            rendered = render(conv, template=self.template, enable_thinking=enable,
                              preserve_thinking=preserve_thinking)
        except RenderError as exc:
            raise ApiError(400, str(exc)) from None
        # Split-encode at the stable boundary so the stable prefix tokenizes the same way
        # whatever follows it (prefix reuse restores exactly these tokens).
        head = self.tokenizer.encode(rendered.text[: rendered.stable_len])
        tail = self.tokenizer.encode(rendered.text[rendered.stable_len:])
        return Prompt(ids=head + tail, text=rendered.text, stable_tokens=len(head) or None,
                      starts_in_reasoning=rendered.text.endswith(THINK_OPEN))

    def raw_prompt(self, text: str | None = None, ids: list[int] | None = None) -> Prompt:
        if ids is None:
            ids = self.tokenizer.encode(text or "")
        return Prompt(ids=list(ids), text=text or "", stable_tokens=None, starts_in_reasoning=False)

    def check_context(self, prompt: Prompt, overflow_error) -> None:
        """overflow_error(n, limit) -> ApiError in the calling API's words."""
        if not prompt.ids:
            raise ApiError(400, "the prompt is empty")
        if len(prompt.ids) > self.max_prompt_tokens:
            raise overflow_error(len(prompt.ids), self.max_prompt_tokens)

    def max_tokens(self, requested: int | None, prompt: Prompt) -> int:
        """The client's limit (or the server default), clamped to what the context has left."""
        wanted = self.config.default_max_tokens if requested is None else requested
        wanted = min(wanted, self.config.max_tokens_ceiling or wanted)  # the server's ceiling (CPU path)
        return max(1, min(wanted, self.max_context - len(prompt.ids)))

    def reasoning_budget(self, requested: int | None, max_tokens: int) -> int:
        """Think-token cap: the request's, else the server's, else half of max_tokens, so an
        answer always has room after a forced close."""
        budget = requested if requested is not None else self.config.reasoning_budget
        if budget is None:
            budget = max(1, max_tokens // 2)
        return max(1, min(budget, max_tokens - 1)) if max_tokens > 1 else 1

    def sampling(self, *, temperature=None, top_p=None, top_k=None, min_p=None, seed=None) -> SamplingParams:
        return SamplingParams(
            temperature=self.config.default_temperature if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=0 if top_k is None else top_k,
            min_p=0.0 if min_p is None else min_p,
            seed=seed)

    def splitter_factory(self, conv: Conversation | None):
        if conv is None:
            return turn_mod.RawSplitter
        from q27py.chat.stream import StreamSplitter

        # Deferred tools too: the model may call one once a tool_reference has shown it.
        schemas = {spec.name: spec.parameters or {} for spec in conv.tools}

        def make(in_reasoning: bool):
            return StreamSplitter(schemas, in_reasoning=in_reasoning)

        return make

    def plan(self, prompt: Prompt, *, conv: Conversation | None, max_tokens: int, sampling: SamplingParams,
             stop_sequences=(), reasoning_budget: int | None = None,
             stop_after_tool_call: bool = False) -> TurnPlan:
        return TurnPlan(prompt_ids=prompt.ids, max_tokens=max_tokens, sampling=sampling,
                        stop_ids=self.stop_ids, stop_sequences=tuple(stop_sequences),
                        stable_len=prompt.stable_tokens, starts_in_reasoning=prompt.starts_in_reasoning,
                        reasoning_budget=reasoning_budget, stop_after_tool_call=stop_after_tool_call,
                        make_splitter=self.splitter_factory(conv))

    # ---- running ---------------------------------------------------------

    def events(self, plan: TurnPlan):
        """The turn's events (see turn.run_turn); close it (aclosing) to cancel the generation."""
        return turn_mod.run_turn(self.bridge, self.tokenizer, plan, ping_interval_s=self.ping_interval_s)

    async def collect(self, plan: TurnPlan) -> TurnResult:
        """Run a turn to the end and gather it (non-streaming responses)."""
        from q27py.chat import stream as cs

        result = TurnResult()
        calls: dict[int, ToolCallResult] = {}
        async with aclosing(self.events(plan)) as events:
            async for ev in events:
                if ev is KEEPALIVE:
                    continue
                if isinstance(ev, cs.TextDelta):
                    result.text += ev.text
                elif isinstance(ev, cs.ReasoningDelta):
                    result.reasoning += ev.text
                elif isinstance(ev, cs.ToolCallStart):
                    calls[ev.index] = ToolCallResult(ev.index, ev.name, "")
                elif isinstance(ev, cs.ToolCallEnd):
                    call = calls.setdefault(ev.index, ToolCallResult(ev.index, "", ""))
                    call.arguments = ev.arguments_json
                    result.tool_calls.append(call)
                elif isinstance(ev, Finish):
                    result.finish = ev
        self.record(result.finish)
        return result

    def record(self, finish: Finish | None) -> None:
        if finish is None:
            return
        u: Usage = finish.usage
        if finish.reason == "cancelled":
            self.metrics.count_disconnect()
        self.metrics.count_generation(prompt=u.prompt_tokens, cached=u.cached_tokens,
                                      generated=u.completion_tokens, reasoning=u.reasoning_tokens,
                                      finish_reason=finish.reason)
