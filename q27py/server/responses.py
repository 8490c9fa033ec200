"""OpenAI Responses (what Codex speaks): POST /v1/responses.

Stream: response.created, response.in_progress, then per output item
output_item.added -> deltas -> output_item.done (reasoning items with
reasoning_text deltas; message items with content_part / output_text events;
function_call items with function_call_arguments deltas; custom_tool_call items
with custom_tool_call_input events), and finally response.completed carrying
`usage` (Codex compacts from it). Every event has a sequence_number.
`response.in_progress` is repeated while the engine is silent: Codex resets its
idle timer only on real events.

Namespaced tools were flattened for the model ("ns__name"); calls go back as
{"namespace": ns, "name": name}. Custom (freeform) tools go back as
custom_tool_call with the raw `input` string. Overflow is a 400 with code
context_length_exceeded.
"""

from __future__ import annotations

import json
import logging
import secrets
import time

from q27py.chat import stream as cs
from q27py.chat.conversation import CUSTOM_TOOL_INPUT
from q27py.server import control, sse
from q27py.server.errors import ApiError
from q27py.server.params import Fields
from q27py.server.request import ChatRequest, conversation, read_sampling, read_template_thinking, refuse_unhonoured
from q27py.server.service import Prompt, TurnResult
from q27py.server.turn import KEEPALIVE, Finish, Logprobs, Usage

log = logging.getLogger("q27py.server")


def overflow_error(prompt_tokens: int, limit: int) -> ApiError:
    return ApiError(400, f"Your input exceeds the context window of this model: {prompt_tokens} tokens > "
                         f"{limit} maximum. Please adjust your input and try again.",
                    param="input", code="context_length_exceeded")


def usage_object(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.total_tokens}


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# Request fields the response object repeats back.
ECHOED = ("instructions", "max_output_tokens", "parallel_tool_calls", "reasoning", "temperature", "top_p",
          "tool_choice", "tools", "text", "top_logprobs")


def read(body: dict) -> ChatRequest:
    """The body in one pass, every field checked where it is read."""
    f = Fields(body)
    req = ChatRequest(api="responses", model=f.string("model", required=True))
    if f.boolean("background", False):
        raise ApiError(400, "background: background responses are not supported", param="background")
    refuse_unhonoured(f)
    req.stream = bool(f.boolean("stream", False))
    read_sampling(f, req, top_k_minimum=-1)
    req.max_tokens = f.integer("max_output_tokens", minimum=1)
    req.stop_after_tool_call = f.boolean("parallel_tool_calls") is False
    read_template_thinking(f, req)
    req.response_format = control.responses_format(body)
    req.logprobs = control.responses_logprobs(body)
    req.penalties = control.penalties(body)
    req.conv, req.tool_choice = conversation("responses", body)
    req.echo = {key: body[key] for key in ECHOED if key in body}
    return req


def emitter(req: ChatRequest, prompt: Prompt) -> "_Emitter":
    return _Emitter(_ResponseShell(req.model, req.echo), req.conv)


def whole(req: ChatRequest, prompt: Prompt, result: TurnResult) -> dict:
    return _ResponseShell(req.model, req.echo).finished(_output_items(req.conv, result), result.finish)


class _ResponseShell:
    """The response object's fixed fields, echoed from the request."""

    def __init__(self, model: str, body: dict):
        self.id = _new_id("resp_")
        self.created_at = int(time.time())
        self.model = model
        self.body = body

    def object(self, status: str, output: list, usage: dict | None = None, **extra) -> dict:
        body = self.body
        reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
        obj = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "model": self.model, "output": output, "usage": usage, "error": None,
               "incomplete_details": None, "instructions": body.get("instructions"),
               "max_output_tokens": body.get("max_output_tokens"), "metadata": {},
               "parallel_tool_calls": body.get("parallel_tool_calls", True),
               "previous_response_id": None,
               "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
               "store": False, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
               "text": body.get("text") if isinstance(body.get("text"), dict) else {"format": {"type": "text"}},
               "top_logprobs": body.get("top_logprobs"), "tool_choice": body.get("tool_choice", "auto"),
               "tools": body.get("tools") or [], "truncation": "disabled"}
        obj.update(extra)
        return obj

    def finished(self, output: list, finish: Finish) -> dict:
        usage = usage_object(finish.usage)
        if finish.reason == "length":
            return self.object("incomplete", output, usage,
                               incomplete_details={"reason": "max_output_tokens"})
        return self.object("completed", output, usage)


def _call_item(conv, name: str, arguments: str, status: str = "completed") -> dict:
    """A function_call or custom_tool_call item, with the client's namespace and name restored."""
    spec = conv.tool(name)
    call_id = _new_id("call_")
    if spec is not None and spec.kind == "custom":
        item = {"type": "custom_tool_call", "id": _new_id("ctc_"), "call_id": call_id,
                "name": spec.api_name, "input": _custom_input(arguments), "status": status}
    else:
        item = {"type": "function_call", "id": _new_id("fc_"), "call_id": call_id,
                "name": spec.api_name if spec is not None else name, "arguments": arguments, "status": status}
    if spec is not None and spec.namespace:
        item["namespace"] = spec.namespace
    return item


def _custom_input(arguments: str) -> str:
    """A freeform tool's raw text, from the one-string-parameter call the model made."""
    try:
        value = json.loads(arguments).get(CUSTOM_TOOL_INPUT, "") if arguments else ""
    except (ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else json.dumps(value)


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": _new_id("rs_"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None,
            "status": "completed"}


def _message_item(text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    return {"type": "message", "id": _new_id("msg_"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _output_items(conv, result: TurnResult) -> list[dict]:
    items = []
    if result.reasoning:
        items.append(_reasoning_item(result.reasoning))
    if result.text:
        items.append(_message_item(result.text, logprobs=result.logprobs))
    for call in result.tool_calls:
        items.append(_call_item(conv, call.name, call.arguments))
    return items


class _Emitter:
    def __init__(self, shell: _ResponseShell, conv):
        self.shell = shell
        self.conv = conv
        self.seq = 0
        self.output: list[dict] = []  # finished items
        self.item: dict | None = None  # the item being streamed
        self.text = ""
        self.call_index: int | None = None
        self.logprobs: list = []  # every token's entry so far: the message's output_text carries them

    def _event(self, name: str, payload: dict) -> bytes:
        payload = {"type": name, "sequence_number": self.seq, **payload}
        self.seq += 1
        return sse.event(name, payload)

    @property
    def _output_index(self) -> int:
        return len(self.output)

    def start(self) -> bytes:
        snapshot = self.shell.object("in_progress", [])
        return (self._event("response.created", {"response": snapshot})
                + self._event("response.in_progress", {"response": snapshot}))

    def _add(self, item: dict) -> bytes:
        out = self._close()
        self.item = item
        self.text = ""
        return out + self._event("response.output_item.added", {"output_index": self._output_index, "item": item})

    def _close(self) -> bytes:
        item = self.item
        if item is None:
            return b""
        idx = self._output_index
        out = b""
        kind = item["type"]
        if kind == "reasoning":
            out += self._event("response.reasoning_text.done", {"item_id": item["id"], "output_index": idx,
                                                                "content_index": 0, "text": self.text})
            item = _reasoning_item(self.text) | {"id": item["id"]}
        elif kind == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}
            out += self._event("response.output_text.done", {"item_id": item["id"], "output_index": idx,
                                                             "content_index": 0, "text": self.text,
                                                             "logprobs": self.logprobs})
            out += self._event("response.content_part.done", {"item_id": item["id"], "output_index": idx,
                                                              "content_index": 0, "part": part})
            item = _message_item(self.text, logprobs=self.logprobs) | {"id": item["id"]}
        self.item = None
        self.output.append(item)
        return out + self._event("response.output_item.done", {"output_index": idx, "item": item})

    def on(self, ev) -> bytes:
        if ev is KEEPALIVE:
            return self._event("response.in_progress", {"response": self.shell.object("in_progress", [])})
        if isinstance(ev, Logprobs):
            self.logprobs.extend(ev.entries)
            return b""
        if isinstance(ev, cs.ReasoningDelta):
            out = b""
            if self.item is None or self.item["type"] != "reasoning":
                out = self._add({"type": "reasoning", "id": _new_id("rs_"), "summary": [], "content": [],
                                 "encrypted_content": None, "status": "in_progress"})
            self.text += ev.text
            return out + self._event("response.reasoning_text.delta", {
                "item_id": self.item["id"], "output_index": self._output_index, "content_index": 0,
                "delta": ev.text})
        if isinstance(ev, cs.TextDelta):
            out = b""
            if self.item is None or self.item["type"] != "message":
                item = _message_item("", "in_progress")
                item["content"] = []
                out = self._add(item)
                out += self._event("response.content_part.added", {
                    "item_id": item["id"], "output_index": self._output_index, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})
            self.text += ev.text
            return out + self._event("response.output_text.delta", {
                "item_id": self.item["id"], "output_index": self._output_index, "content_index": 0,
                "delta": ev.text, "logprobs": []})
        if isinstance(ev, cs.ToolCallStart):
            out = self._close()
            self.call_index = ev.index
            item = _call_item(self.conv, ev.name, "", "in_progress")
            if item["type"] == "custom_tool_call":
                item["input"] = ""
            self.item = item
            self.text = ""
            return out + self._event("response.output_item.added", {"output_index": self._output_index,
                                                                    "item": item})
        if isinstance(ev, cs.ToolCallArgsDelta):
            item = self.item
            if item is None or item["type"] != "function_call" or not ev.json_fragment:
                return b""  # custom tool input is sent whole at the end (it is not JSON)
            self.text += ev.json_fragment
            return self._event("response.function_call_arguments.delta", {
                "item_id": item["id"], "output_index": self._output_index, "delta": ev.json_fragment})
        if isinstance(ev, cs.ToolCallEnd):
            item = self.item
            if item is None or item["type"] not in ("function_call", "custom_tool_call"):
                return b""
            idx = self._output_index
            out = b""
            if item["type"] == "function_call":
                sent = self.text
                if ev.arguments_json != sent and ev.arguments_json.startswith(sent):
                    out += self._event("response.function_call_arguments.delta", {
                        "item_id": item["id"], "output_index": idx, "delta": ev.arguments_json[len(sent):]})
                out += self._event("response.function_call_arguments.done", {
                    "item_id": item["id"], "output_index": idx, "arguments": ev.arguments_json})
                done = dict(item, arguments=ev.arguments_json, status="completed")
            else:
                value = _custom_input(ev.arguments_json)
                out += self._event("response.custom_tool_call_input.delta", {
                    "item_id": item["id"], "call_id": item["call_id"], "output_index": idx, "delta": value})
                out += self._event("response.custom_tool_call_input.done", {
                    "item_id": item["id"], "call_id": item["call_id"], "output_index": idx, "input": value})
                done = dict(item, input=value, status="completed")
            self.item = None
            self.output.append(done)
            return out + self._event("response.output_item.done", {"output_index": idx, "item": done})
        return b""

    def finish(self, finish: Finish) -> bytes:
        out = self._close()
        final = self.shell.finished(self.output, finish)
        name = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return out + self._event(name, {"response": final})

    def failure(self, message: str) -> bytes:
        failed = self.shell.object("failed", self.output,
                                   error={"code": "server_error", "message": message})
        return self._event("response.failed", {"response": failed})
