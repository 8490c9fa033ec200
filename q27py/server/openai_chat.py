"""OpenAI Chat Completions: POST /v1/chat/completions.

Streaming is `data:`-only SSE ending in `data: [DONE]`: a first chunk with the
role, then delta.reasoning_content / delta.content / delta.tool_calls (the first
chunk of a call carries id, type and name with empty arguments, later ones
only argument fragments), a last chunk with finish_reason, and with
stream_options.include_usage one more chunk with `choices: []` and the usage
(every earlier chunk then carries `"usage": null`).
"""

from __future__ import annotations

import logging
import secrets
import time

from q27py.chat import stream as cs
from q27py.server import control, sse
from q27py.server.errors import ApiError, bad_request
from q27py.server.params import Fields
from q27py.server.request import ChatRequest, conversation, read_sampling, read_template_thinking, refuse_unhonoured
from q27py.server.service import Prompt, TurnResult
from q27py.server.turn import KEEPALIVE, Finish, Logprobs, Usage

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


def include_usage(f: Fields) -> bool:
    options = f.obj("stream_options") or {}
    return Fields(options, "stream_options.").boolean("include_usage", False) is True


def read(body: dict) -> ChatRequest:
    """The body in one pass, every field checked where it is read."""
    f = Fields(body)
    req = ChatRequest(api="openai", model=f.string("model", required=True))
    refuse_unhonoured(f)
    req.stream = bool(f.boolean("stream", False))
    read_sampling(f, req, top_k_minimum=-1)
    req.thinking_budget = f.integer("thinking_budget", minimum=1)
    req.max_tokens = f.integer("max_completion_tokens", minimum=1)
    if req.max_tokens is None:
        req.max_tokens = f.integer("max_tokens", minimum=1)
    req.stop = f.stop_list("stop", strict=False)
    req.stop_after_tool_call = f.boolean("parallel_tool_calls") is False
    req.include_usage = include_usage(f)
    read_template_thinking(f, req)
    req.response_format = control.openai_format(body)
    req.logprobs = control.chat_logprobs(body)
    req.penalties = control.penalties(body)
    req.conv, req.tool_choice = conversation("openai", body)
    return req


def emitter(req: ChatRequest, prompt: Prompt) -> "_Emitter":
    return _Emitter("chatcmpl-" + secrets.token_hex(12), req.model, req.conv, req.include_usage)


def _logprobs_field(req: ChatRequest, entries: list) -> dict | None:
    return {"content": entries, "refusal": None} if req.logprobs is not None else None


def whole(req: ChatRequest, prompt: Prompt, result: TurnResult) -> dict:
    out = _completion_object("chatcmpl-" + secrets.token_hex(12), req.model, req.conv, result)
    out["choices"][0]["logprobs"] = _logprobs_field(req, result.logprobs)
    return out


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


class OpenAIStream:
    """What the Chat Completions and Completions streams share: chunk framing (with
    `"usage": null` when a usage chunk follows), the final chunk, the usage chunk, [DONE]
    and the error. Subclasses say what one choice holds (`field`: delta or text)."""

    object_name = "chat.completion.chunk"
    field = "delta"
    empty: object = {}

    def __init__(self, cid: str, model: str, with_usage: bool):
        self.cid = cid
        self.model = model
        self.with_usage = with_usage
        self.created = int(time.time())

    def chunk(self, content, finish_reason: str | None = None, logprobs=None) -> bytes:
        payload = {"id": self.cid, "object": self.object_name, "created": self.created, "model": self.model,
                   "choices": [{"index": 0, self.field: content, "logprobs": logprobs,
                                "finish_reason": finish_reason}]}
        if self.with_usage:
            payload["usage"] = None
        return sse.data(payload)

    def finish(self, finish: Finish) -> bytes:
        out = self.chunk(self.empty, FINISH_REASONS.get(finish.reason, "stop"))
        if self.with_usage:
            out += sse.data({"id": self.cid, "object": self.object_name, "created": self.created,
                             "model": self.model, "choices": [], "usage": usage_object(finish.usage)})
        return out + sse.DONE

    def failure(self, message: str) -> bytes:
        return sse.data({"error": {"message": message, "type": "server_error", "param": None,
                                   "code": None}}) + sse.DONE


class _Emitter(OpenAIStream):
    def __init__(self, cid: str, model: str, conv, with_usage: bool):
        super().__init__(cid, model, with_usage)
        self.conv = conv
        self.args_sent: dict[int, str] = {}

    def start(self) -> bytes:
        return self.chunk({"role": "assistant", "content": ""})

    def on(self, ev) -> bytes:
        if ev is KEEPALIVE:
            return sse.KEEPALIVE_COMMENT
        if isinstance(ev, Logprobs):  # after the chunk's text: a delta-less chunk carrying them
            return self.chunk({}, logprobs={"content": ev.entries, "refusal": None})
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
