"""OpenAI Chat Completions: POST /v1/chat/completions.

Streaming is `data:`-only SSE ending in `data: [DONE]`: a first chunk with the
role, then delta.reasoning_content / delta.content / delta.tool_calls (the first
chunk of a call carries id, type and name with empty arguments, later ones
only argument fragments), a last chunk with finish_reason, and with
stream_options.include_usage one more chunk with `choices: []` and the usage
(every earlier chunk then carries `"usage": null`).
"""

from __future__ import annotations

import json
import logging
import secrets
import time

from q27py.chat import stream as cs
from q27py.server import sse
from q27py.server.errors import ApiError, bad_request
from q27py.server.http import Request, Response, StreamingResponse
from q27py.server.params import Fields
from q27py.server.service import ChatService, TurnResult
from q27py.server.streaming import stream_turn
from q27py.server.turn import KEEPALIVE, Finish, TurnPlan, Usage

log = logging.getLogger("q27py.server")

FINISH_REASONS = {"stop": "stop", "stop_sequence": "stop", "tool_calls": "tool_calls", "length": "length",
                  "cancelled": "stop", "error": "stop"}


def overflow_error(prompt_tokens: int, limit: int, param: str = "messages") -> ApiError:
    return ApiError(400, f"This model's maximum context length is {limit} tokens for the prompt. However, "
                         f"your request has {prompt_tokens} input tokens. Please reduce the length of the input.",
                    param=param, code="context_length_exceeded")


def usage_object(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}


def reject_unsupported(f: Fields) -> None:
    """Options we cannot honour are refused by name rather than silently ignored."""
    n = f.integer("n", minimum=1)
    if n is not None and n > 1:
        raise bad_request("n: only n=1 is supported", "n")
    if f.boolean("logprobs", False) or f.present("top_logprobs"):
        raise bad_request("logprobs: log probabilities are not supported", "logprobs")
    for key in ("presence_penalty", "frequency_penalty"):
        if f.number(key, minimum=-2, maximum=2, default=0.0) != 0.0:
            raise bad_request(f"{key}: penalties are not supported (send 0 or omit it)", key)
    if f.obj("logit_bias"):
        raise bad_request("logit_bias: not supported", "logit_bias")
    rf = f.obj("response_format")
    if rf is not None and rf.get("type") not in (None, "text"):
        raise bad_request(f"response_format: type {rf.get('type')!r} is not supported (no constrained "
                          "decoding); use 'text'", "response_format")


def sampling_from(svc: ChatService, f: Fields):
    top_k = f.integer("top_k", minimum=-1)
    return svc.sampling(temperature=f.number("temperature", minimum=0, maximum=2),
                        top_p=f.number("top_p", minimum=0, maximum=1),
                        top_k=None if top_k in (None, -1) else top_k,
                        min_p=f.number("min_p", minimum=0, maximum=1),
                        seed=f.integer("seed"))


def include_usage(f: Fields) -> bool:
    options = f.obj("stream_options") or {}
    return Fields(options).boolean("include_usage", False) is True


async def chat_completions(svc: ChatService, request: Request, body: dict) -> Response | StreamingResponse:
    f = Fields(body)
    model = f.string("model", required=True)
    reject_unsupported(f)
    f.boolean("stream", False)
    sampling = sampling_from(svc, f)
    budget = f.integer("thinking_budget", minimum=1)
    conv, opts = svc.conversation("openai", body)
    prompt = svc.render(conv, thinking=opts.enable_thinking, preserve_thinking=opts.preserve_thinking)
    svc.check_context(prompt, overflow_error)
    max_tokens = svc.max_tokens(opts.max_tokens, prompt)
    plan = svc.plan(prompt, conv=conv, max_tokens=max_tokens, sampling=sampling, stop_sequences=opts.stop,
                    reasoning_budget=svc.reasoning_budget(budget, max_tokens),
                    stop_after_tool_call=opts.parallel_tool_calls is False)
    cid = "chatcmpl-" + secrets.token_hex(12)
    if opts.stream:
        return StreamingResponse(200, _stream(svc, plan, conv, model, cid, opts.include_usage))
    result = await svc.collect(plan)
    return Response(200, json.dumps(_completion_object(cid, model, conv, result), ensure_ascii=False).encode())


def _api_tool_name(conv, name: str) -> str:
    spec = conv.tool(name)
    return spec.api_name if spec is not None else name


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _completion_object(cid: str, model: str, conv, result: TurnResult) -> dict:
    message: dict = {"role": "assistant", "content": result.text or None}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [{"id": _call_id(), "type": "function",
                                  "function": {"name": _api_tool_name(conv, c.name), "arguments": c.arguments}}
                                 for c in result.tool_calls]
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": FINISH_REASONS.get(result.finish.reason, "stop")}],
            "usage": usage_object(result.finish.usage)}


class _Emitter:
    def __init__(self, cid: str, model: str, conv, with_usage: bool):
        self.cid = cid
        self.model = model
        self.conv = conv
        self.with_usage = with_usage
        self.created = int(time.time())
        self.args_sent: dict[int, str] = {}

    def chunk(self, delta: dict, finish_reason: str | None = None) -> bytes:
        payload = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created,
                   "model": self.model,
                   "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        if self.with_usage:
            payload["usage"] = None
        return sse.data(payload)

    def start(self) -> bytes:
        return self.chunk({"role": "assistant", "content": ""})

    def on(self, ev) -> bytes:
        if ev is KEEPALIVE:
            return sse.KEEPALIVE_COMMENT
        if isinstance(ev, cs.ReasoningDelta):
            return self.chunk({"reasoning_content": ev.text})
        if isinstance(ev, cs.TextDelta):
            return self.chunk({"content": ev.text})
        if isinstance(ev, cs.ToolCallStart):
            self.args_sent[ev.index] = ""
            return self.chunk({"tool_calls": [{"index": ev.index, "id": _call_id(), "type": "function",
                                               "function": {"name": _api_tool_name(self.conv, ev.name),
                                                            "arguments": ""}}]})
        if isinstance(ev, cs.ToolCallArgsDelta):
            if not ev.json_fragment:
                return b""
            self.args_sent[ev.index] = self.args_sent.get(ev.index, "") + ev.json_fragment
            return self._args(ev.index, ev.json_fragment)
        if isinstance(ev, cs.ToolCallEnd):
            sent = self.args_sent.get(ev.index, "")
            if ev.arguments_json != sent and ev.arguments_json.startswith(sent):
                return self._args(ev.index, ev.arguments_json[len(sent):])
            if ev.arguments_json != sent:
                log.error("tool call %d: streamed arguments disagree with the final ones", ev.index)
        return b""

    def _args(self, index: int, fragment: str) -> bytes:
        return self.chunk({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})

    def finish(self, finish: Finish) -> bytes:
        out = self.chunk({}, FINISH_REASONS.get(finish.reason, "stop"))
        if self.with_usage:
            out += sse.data({"id": self.cid, "object": "chat.completion.chunk", "created": self.created,
                             "model": self.model, "choices": [], "usage": usage_object(finish.usage)})
        return out + sse.DONE

    def failure(self, message: str) -> bytes:
        return sse.data({"error": {"message": message, "type": "server_error", "param": None,
                                   "code": None}}) + sse.DONE


async def _stream(svc: ChatService, plan: TurnPlan, conv, model: str, cid: str, with_usage: bool):
    async for chunk in stream_turn(svc, plan, _Emitter(cid, model, conv, with_usage)):
        yield chunk
