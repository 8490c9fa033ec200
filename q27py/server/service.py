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
from q27py.chat.render import THINK_OPEN, RenderError, encode_rendered, render
from q27py.chat.textstage import FORCED_THINK_CLOSE, RawSplitter
from q27py.config import ServerConfig
from q27py.engine.api import SamplingParams, clamp_max_tokens, max_prompt_tokens
from q27py.server import turn as turn_mod
from q27py.server.bridge import EngineBridge
from q27py.server.errors import ApiError
from q27py.server.metrics import Metrics
from q27py.server.turn import KEEPALIVE, Finish, Logprobs, TurnPlan, Usage

log = logging.getLogger("q27py.server")

# Temperatures below this sample as greedy (see ChatService.sampling).
MIN_TEMPERATURE = 1e-5

@dataclass
class Prompt:
    ids: list[int]
    text: str
    stable_tokens: int | None  # prompt tokens up to the renderer's stable boundary
    starts_in_reasoning: bool  # the prompt ends inside an open <think>
    system_tokens: int | None = None  # prompt tokens of the leading system turn (shared across chats)


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
    logprobs: list = field(default_factory=list)  # content entries (server/control.py), when asked


class ChatService:
    def __init__(self, bridge: EngineBridge, tokenizer, *, model_name: str, template: str,
                 stop_ids, config: ServerConfig | None = None, metrics: Metrics | None = None,
                 ping_interval_s: float = 10.0, tool_dialect: str = "xml"):
        self.tool_dialect = tool_dialect  # the checkpoint's call syntax: forced calls use it
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
        return max_prompt_tokens(self.max_context)

    # ---- prompts ---------------------------------------------------------

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
        ids, system_tokens, stable_tokens = encode_rendered(self.tokenizer, rendered)
        return Prompt(ids=ids, text=rendered.text, stable_tokens=stable_tokens or None,
                      starts_in_reasoning=rendered.text.endswith(THINK_OPEN), system_tokens=system_tokens or None)

    def raw_prompt(self, text: str | None = None, ids: list[int] | None = None) -> Prompt:
        """A prompt used as is (no chat template): text, or token ids checked against the vocabulary."""
        if ids is None:
            ids = self.tokenizer.encode(text or "")
        else:
            vocab = getattr(self.tokenizer, "vocab_size", None)
            if any(t < 0 or (vocab is not None and t >= vocab) for t in ids):
                raise ApiError(400, "prompt: token id out of range", param="prompt")
            text = self.tokenizer.decode(ids)
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
        return max(1, clamp_max_tokens(wanted, len(prompt.ids), self.max_context))

    def reasoning_budget(self, requested: int | None, max_tokens: int) -> int:
        """Think-token cap: the request's, else the server's, else half of max_tokens, and
        always leaving room for the forced close (counted in max_tokens) plus one answer
        token. When max_tokens is too small for that, the turn ends at length instead."""
        budget = requested if requested is not None else self.config.reasoning_budget
        if budget is None:
            budget = max(1, max_tokens // 2)
        room = max_tokens - len(self.tokenizer.encode(FORCED_THINK_CLOSE)) - 1
        return max(1, min(budget, room))

    def sampling(self, *, temperature=None, top_p=None, top_k=None, min_p=None, seed=None) -> SamplingParams:
        """The engine's sampling settings. Edge values are defined here, at the boundary, for
        every API alike (docs/SERVER.md): top_p 0 keeps only the most probable token, i.e.
        greedy (as other servers treat it; the sampler itself needs top_p > 0), and a
        temperature below MIN_TEMPERATURE (a denormal like 1e-310 would overflow the logits
        / temperature division) is greedy too."""
        temperature = self.config.default_temperature if temperature is None else temperature
        top_p = 1.0 if top_p is None else top_p
        if top_p == 0 or temperature < MIN_TEMPERATURE:
            temperature, top_p = 0.0, 1.0
        return SamplingParams(temperature=temperature, top_p=top_p,
                              top_k=0 if top_k is None else top_k,
                              min_p=0.0 if min_p is None else min_p,
                              seed=seed)

    def splitter_factory(self, conv: Conversation | None, tool_calls: bool = True):
        """tool_calls False (tool_choice "none"): calls the model writes anyway stay text."""
        if conv is None:
            return RawSplitter
        from q27py.chat.stream import StreamSplitter

        # Deferred tools too: the model may call one once a tool_reference has shown it.
        schemas = {spec.name: spec.parameters or {} for spec in conv.tools}

        def make(in_reasoning: bool):
            return StreamSplitter(schemas, in_reasoning=in_reasoning, tool_calls=tool_calls)

        return make

    def plan(self, prompt: Prompt, *, conv: Conversation | None, max_tokens: int, sampling: SamplingParams,
             stop_sequences=(), reasoning_budget: int | None = None,
             stop_after_tool_call: bool = False, tool_calls: bool = True, constraint=None,
             logprobs: int | None = None) -> TurnPlan:
        return TurnPlan(prompt_ids=prompt.ids, max_tokens=max_tokens, sampling=sampling,
                        stop_ids=self.stop_ids, stop_sequences=tuple(stop_sequences),
                        stable_len=prompt.stable_tokens, system_len=prompt.system_tokens,
                        starts_in_reasoning=prompt.starts_in_reasoning,
                        reasoning_budget=reasoning_budget, stop_after_tool_call=stop_after_tool_call,
                        make_splitter=self.splitter_factory(conv, tool_calls), constraint=constraint,
                        logprobs=logprobs)

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
                elif isinstance(ev, Logprobs):
                    result.logprobs.extend(ev.entries)
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
