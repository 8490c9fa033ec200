"""Anthropic Messages: POST /v1/messages and /v1/messages/count_tokens.

Streaming follows the documented grammar Claude Code parses (every event has an
`event:` line): message_start, then content blocks (thinking with a
signature_delta before its stop, text, tool_use with input_json_delta), then
message_delta with stop_reason and cumulative usage, then message_stop. `ping`
is sent while the engine is silent (queue, long prefill).

Context overflow is HTTP 400 invalid_request_error "prompt is too long: N tokens
> M maximum": Claude Code matches exactly that and compacts the conversation.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import secrets

import trio

from q27py.chat import stream as cs
from q27py.server import control, sse
from q27py.server.errors import ApiError, bad_request
from q27py.server.http import Request, Response
from q27py.server.params import Fields
from q27py.server.request import ChatRequest, build_prompt, conversation, json_response, read_sampling
from q27py.server.service import ChatService, Prompt, TurnResult
from q27py.server.turn import KEEPALIVE, Finish, Usage

log = logging.getLogger("q27py.server")

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens",
                "stop_sequence": "stop_sequence", "cancelled": "end_turn", "error": "end_turn"}


def overflow_error(prompt_tokens: int, limit: int) -> ApiError:
    return ApiError(400, f"prompt is too long: {prompt_tokens} tokens > {limit} maximum")


def thinking_signature(text: str) -> str:
    """An opaque signature for a thinking block; clients echo it back and we do not check it."""
    return base64.b64encode(hashlib.sha256(b"q27py-thinking\0" + text.encode("utf-8")).digest()).decode()


def read(body: dict, *, counting: bool = False) -> ChatRequest:
    """The body in one pass; `counting` (count_tokens) needs no max_tokens or sampling."""
    f = Fields(body)
    req = ChatRequest(api="anthropic", model=f.string("model", required=True))
    req.conv, req.tool_choice = conversation("anthropic", body)
    _read_thinking(f, req)
    if counting:
        return req
    req.max_tokens = f.integer("max_tokens", required=True, minimum=1)
    read_sampling(f, req, min_p=False)
    req.stop = f.stop_list("stop_sequences", strict=False)
    req.stream = bool(f.boolean("stream", False))
    tool_choice = f.obj("tool_choice") or {}
    req.stop_after_tool_call = tool_choice.get("disable_parallel_tool_use") is True
    req.response_format = control.anthropic_format(body)  # output_config.format (structured output)
    return req


def _read_thinking(f: Fields, req: ChatRequest) -> None:
    thinking = f.obj("thinking")
    if thinking is None:
        return
    t = Fields(thinking, "thinking.")
    kind = thinking.get("type")
    if kind == "disabled":
        req.enable_thinking = False
        return
    if kind not in ("enabled", "adaptive"):
        raise bad_request("thinking.type: expected enabled, adaptive or disabled", "thinking.type")
    # "adaptive" is "the model decides" (Claude Code always sends it): here the server's default decides.
    req.enable_thinking = True if kind == "enabled" else None
    req.thinking_budget = t.integer("budget_tokens", minimum=1)




async def count_tokens(svc: ChatService, request: Request, body: dict) -> Response:
    prompt = await trio.to_thread.run_sync(lambda: build_prompt(svc, read(body, counting=True)))
    return json_response(200, {"input_tokens": len(prompt.ids)})


def emitter(req: ChatRequest, prompt: Prompt) -> "_Emitter":
    return _Emitter(req.model, req.conv, len(prompt.ids))


def whole(req: ChatRequest, prompt: Prompt, result: TurnResult) -> dict:
    return _message_object(_message_id(), req.model, req.conv, result)


def _message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def _api_tool_name(conv, name: str) -> str:
    spec = conv.tool(name)
    return spec.api_name if spec is not None else name


def _usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


def _parse_arguments(arguments: str) -> dict:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        log.error("tool call arguments are not valid JSON: %r", arguments[:200])
        return {}
    return value if isinstance(value, dict) else {}


def _message_object(msg_id: str, model: str, conv, result: TurnResult) -> dict:
    content = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning,
                        "signature": thinking_signature(result.reasoning)})
    if result.text:
        content.append({"type": "text", "text": result.text})
    for call in result.tool_calls:
        content.append({"type": "tool_use", "id": _tool_use_id(), "name": _api_tool_name(conv, call.name),
                        "input": _parse_arguments(call.arguments)})
    finish = result.finish
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": STOP_REASONS.get(finish.reason, "end_turn"),
            "stop_sequence": finish.stop_sequence, "usage": _usage(finish.usage)}


class _Emitter:
    """Splitter events -> Anthropic SSE events, one content block open at a time."""

    def __init__(self, model: str, conv, prompt_tokens: int):
        self.model = model
        self.conv = conv
        self.prompt_tokens = prompt_tokens
        self.msg_id = _message_id()
        self.index = -1
        self.open_kind: str | None = None
        self.thinking = ""
        self.args_sent: dict[int, str] = {}

    def start(self) -> bytes:
        message = {"id": self.msg_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}
        return (sse.event("message_start", {"type": "message_start", "message": message})
                + sse.event("ping", {"type": "ping"}))

    def _open(self, block: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.open_kind = block["type"]
        return out + sse.event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                       "content_block": block})

    def _close(self) -> bytes:
        if self.open_kind is None:
            return b""
        out = b""
        if self.open_kind == "thinking":
            out += self._delta({"type": "signature_delta", "signature": thinking_signature(self.thinking)})
            self.thinking = ""
        self.open_kind = None
        return out + sse.event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _delta(self, delta: dict) -> bytes:
        return sse.event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def on(self, ev) -> bytes:
        if ev is KEEPALIVE:
            return sse.event("ping", {"type": "ping"})
        if isinstance(ev, cs.ReasoningDelta):
            out = b"" if self.open_kind == "thinking" else self._open(
                {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += ev.text
            return out + self._delta({"type": "thinking_delta", "thinking": ev.text})
        if isinstance(ev, cs.TextDelta):
            out = b"" if self.open_kind == "text" else self._open({"type": "text", "text": ""})
            return out + self._delta({"type": "text_delta", "text": ev.text})
        if isinstance(ev, cs.ToolCallStart):
            self.args_sent[ev.index] = ""
            return self._open({"type": "tool_use", "id": _tool_use_id(),
                               "name": _api_tool_name(self.conv, ev.name), "input": {}})
        if isinstance(ev, cs.ToolCallArgsDelta):
            if not ev.json_fragment:
                return b""
            self.args_sent[ev.index] = self.args_sent.get(ev.index, "") + ev.json_fragment
            return self._delta({"type": "input_json_delta", "partial_json": ev.json_fragment})
        if isinstance(ev, cs.ToolCallEnd):
            sent = self.args_sent.get(ev.index, "")
            out = b""
            if ev.arguments_json != sent:
                if ev.arguments_json.startswith(sent):
                    out = self._delta({"type": "input_json_delta",
                                       "partial_json": ev.arguments_json[len(sent):]})
                else:
                    log.error("tool call %d: streamed arguments %r disagree with final %r",
                              ev.index, sent[:80], ev.arguments_json[:80])
            return out + self._close()
        return b""

    def finish(self, finish: Finish) -> bytes:
        usage = _usage(finish.usage)
        return (self._close()
                + sse.event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": STOP_REASONS.get(finish.reason, "end_turn"),
                                                        "stop_sequence": finish.stop_sequence},
                                              "usage": usage})
                + sse.event("message_stop", {"type": "message_stop"}))

    def failure(self, message: str) -> bytes:
        return sse.event("error", {"type": "error", "error": {"type": "api_error", "message": message}})
