"""One validated, typed request per call, and the handler pipeline every chat API shares.

Each API module (anthropic.py, openai_chat.py, responses.py, completions.py)
owns its wire format both ways: `read(body) -> ChatRequest` reads the body once,
every field range-checked where it is read (server/params.Fields) and the chat
part mapped by q27py.chat.requests; its emitters map turn events back to that
API's events. Everything between the two is `handle` below, written once:

  read -> prompt (render + tokenize, or raw text / ids) -> context check
       -> max_tokens + reasoning budget -> plan -> stream (SSE) | collect (JSON)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import trio

from q27py.chat.conversation import Conversation
from q27py.chat.requests import RequestError, ToolChoice, parse_conversation
from q27py.server import control
from q27py.server.errors import ApiError, bad_request
from q27py.server.http import Response, StreamingResponse
from q27py.server.params import Fields
from q27py.server.service import ChatService, Prompt, TurnResult
from q27py.server.streaming import stream_turn
from q27py.server.turn import TurnPlan


@dataclass
class ChatRequest:
    """Everything the pipeline needs from one request, validated. None = "not given"."""

    api: str  # "anthropic" | "openai" | "responses" | "completions"
    model: str
    conv: Conversation | None = None  # None: a raw-text request (/v1/completions)
    raw_prompt: str | list[int] | None = None  # /v1/completions: text or token ids
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    stream: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    enable_thinking: bool | None = None  # None: the server default
    preserve_thinking: bool | None = None
    thinking_budget: int | None = None  # None: the server's / half of max_tokens
    stop_after_tool_call: bool = False  # parallel tool calls disabled
    include_usage: bool = False  # streamed usage chunk (OpenAI stream_options)
    echo: dict = field(default_factory=dict)  # API-specific fields the response repeats
    response_format: control.ResponseFormat | None = None  # structured output (server/control.py)
    logprobs: int | None = None  # None: off; n: the n most likely alternatives per token too
    penalties: control.Penalties = field(default_factory=control.Penalties)


class ApiModule(Protocol):
    """What an API module gives the pipeline (each server/<api>.py module is one)."""

    def read(self, body: dict) -> ChatRequest: ...

    def overflow_error(self, prompt_tokens: int, limit: int) -> ApiError: ...

    def emitter(self, req: ChatRequest, prompt: Prompt): ...  # start/on/finish/failure -> bytes

    def whole(self, req: ChatRequest, prompt: Prompt, result: TurnResult) -> dict: ...


def json_response(status: int, payload: Any) -> Response:
    return Response(status, json.dumps(payload, ensure_ascii=False).encode("utf-8"))


def conversation(api: str, body: dict) -> tuple[Conversation, ToolChoice]:
    """The chat part of the body (chat/requests.py), a 400 naming the field if unreadable."""
    try:
        conv, choice = parse_conversation(api, body)
    except RequestError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    if choice.mode == "none":
        conv.tools = []  # the model is not told about tools it may not call
    return conv, choice


def refuse_unhonoured(f: Fields) -> None:
    """The one rule for options on every API (docs/SERVER.md): an option that would change
    what the client gets and that this server cannot honour is refused with a 400 naming it;
    never silently ignored. (Options that change nothing visible are ignored.) Output formats,
    tool_choice, log probabilities and penalties are honoured (server/control.py reads and
    validates them the same way on every API)."""
    n = f.integer("n", minimum=1)
    if n is not None and n > 1:
        raise bad_request("n: only n=1 is supported", "n")
    if f.obj("logit_bias"):
        raise bad_request("logit_bias: not supported", "logit_bias")


def read_sampling(f: Fields, req: ChatRequest, *, top_k_minimum: int = 0, min_p: bool = True) -> None:
    """temperature / top_p / top_k / min_p / seed, range-checked; top_k -1 means off."""
    req.temperature = f.number("temperature", minimum=0, maximum=2)
    req.top_p = f.number("top_p", minimum=0, maximum=1)
    top_k = f.integer("top_k", minimum=top_k_minimum)
    req.top_k = None if top_k == -1 else top_k
    if min_p:
        req.min_p = f.number("min_p", minimum=0, maximum=1)
    req.seed = f.integer("seed")


def read_template_thinking(f: Fields, req: ChatRequest) -> None:
    """vLLM-style switches: chat_template_kwargs.{enable,preserve}_thinking, enable_thinking,
    then OpenAI's reasoning effort ("none" turns thinking off, any other level on)."""
    kwargs = Fields(f.obj("chat_template_kwargs") or {}, "chat_template_kwargs.")
    req.enable_thinking = kwargs.boolean("enable_thinking")
    req.preserve_thinking = kwargs.boolean("preserve_thinking")
    if req.enable_thinking is None:
        req.enable_thinking = f.boolean("enable_thinking")
    effort = f.string("reasoning_effort")
    reasoning = f.obj("reasoning")
    if effort is None and reasoning is not None:
        effort = Fields(reasoning, "reasoning.").string("effort")
    if req.enable_thinking is None and effort is not None:
        req.enable_thinking = effort != "none"


def build_prompt(svc: ChatService, req: ChatRequest) -> Prompt:
    if req.conv is not None:
        return svc.render(req.conv, thinking=req.enable_thinking, preserve_thinking=req.preserve_thinking)
    if isinstance(req.raw_prompt, str):
        return svc.raw_prompt(text=req.raw_prompt)
    return svc.raw_prompt(ids=req.raw_prompt)


def plan_for(svc: ChatService, api: ApiModule, req: ChatRequest, prompt: Prompt) -> TurnPlan:
    svc.check_context(prompt, api.overflow_error)
    max_tokens = svc.max_tokens(req.max_tokens, prompt)
    budget = svc.reasoning_budget(req.thinking_budget, max_tokens) if req.conv is not None else None
    sampling = replace(svc.sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                    min_p=req.min_p, seed=req.seed),
                       presence_penalty=req.penalties.presence, frequency_penalty=req.penalties.frequency,
                       repetition_penalty=req.penalties.repetition)
    constraint = control.constraint_for(
        req.tool_choice, req.conv.tools if req.conv is not None else [], req.response_format,
        dialect=getattr(svc, "tool_dialect", "xml"), starts_in_reasoning=prompt.starts_in_reasoning,
        one_call=req.stop_after_tool_call)
    return svc.plan(prompt, conv=req.conv, max_tokens=max_tokens, sampling=sampling,
                    stop_sequences=req.stop, reasoning_budget=budget, stop_after_tool_call=req.stop_after_tool_call,
                    tool_calls=req.tool_choice.mode != "none" and bool(req.conv is not None and req.conv.tools),
                    constraint=constraint,
                    logprobs=req.logprobs)


async def handle(svc: ChatService, api: ApiModule, body: dict) -> Response | StreamingResponse:
    """The pipeline every generating endpoint runs (module docstring)."""
    def prepare():
        req = api.read(body)
        prompt = build_prompt(svc, req)
        return req, prompt, plan_for(svc, api, req, prompt)

    # Reading, rendering and tokenizing a large conversation take seconds: a worker thread
    # does them, so the event loop keeps serving /health and open streams (issue 13.5).
    req, prompt, plan = await trio.to_thread.run_sync(prepare)
    if req.stream:
        return StreamingResponse(200, stream_turn(svc, plan, api.emitter(req, prompt)))
    result = await svc.collect(plan)
    return json_response(200, api.whole(req, prompt, result))
