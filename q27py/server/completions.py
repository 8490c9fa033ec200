"""OpenAI Completions: POST /v1/completions, raw text in and out (no chat template, no splitter)."""

from __future__ import annotations

import secrets
import time

from q27py.server import control, sse
from q27py.server.errors import ApiError, bad_request
from q27py.server.openai_chat import FINISH_REASONS, OpenAIStream, include_usage, usage_object
from q27py.server.openai_chat import overflow_error as chat_overflow_error
from q27py.server.params import Fields
from q27py.server.request import ChatRequest, read_sampling
from q27py.server.service import Prompt, TurnResult
from q27py.server.turn import KEEPALIVE, Logprobs

DEFAULT_MAX_TOKENS = 16  # the OpenAI default for this endpoint


def _raw_prompt(value):
    """A string, a one-element list of strings, a list of token ids, or a one-element list of those."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)  # the vocabulary range is checked with the tokenizer (service.raw_prompt)
    if isinstance(value, list) and len(value) > 1:
        raise bad_request("prompt: only one prompt per request is supported", "prompt")
    raise bad_request("prompt: expected a string, a list of token ids, or a one-element list of either", "prompt")


def read(body: dict) -> ChatRequest:
    """The body in one pass, every field checked where it is read."""
    f = Fields(body)
    req = ChatRequest(api="completions", model=f.string("model", required=True))
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt: field required", "prompt")
    n = f.integer("n", minimum=1)
    if (n or 1) > 1 or (f.integer("best_of", minimum=1) or 1) > 1:
        raise bad_request("n / best_of: only one completion per request is supported", "n")
    if f.present("suffix"):
        raise bad_request("suffix: insertion (suffix) is not supported", "suffix")
    req.logprobs = control.completions_logprobs(body)
    req.penalties = control.penalties(body)
    for key in ("response_format", "tool_choice"):
        if f.present(key):  # raw text has no tools and no chat answer to format
            raise bad_request(f"{key}: not supported on /v1/completions (use /v1/chat/completions)", key)
    req.echo = {"echo": f.boolean("echo", False)}
    req.stream = bool(f.boolean("stream", False))
    req.max_tokens = f.integer("max_tokens", minimum=1, default=DEFAULT_MAX_TOKENS)
    read_sampling(f, req, top_k_minimum=-1)
    req.stop = f.stop_list("stop")
    req.include_usage = include_usage(f)
    req.raw_prompt = _raw_prompt(body["prompt"])
    return req


def overflow_error(prompt_tokens: int, limit: int) -> ApiError:
    return chat_overflow_error(prompt_tokens, limit, "prompt")


def _echoed(req: ChatRequest, prompt: Prompt) -> str:
    return prompt.text if req.echo.get("echo") else ""


def emitter(req: ChatRequest, prompt: Prompt) -> "_Emitter":
    return _Emitter("cmpl-" + secrets.token_hex(12), req.model, req.include_usage, _echoed(req, prompt))


def _logprobs(req: ChatRequest, entries: list, offset: int) -> dict | None:
    return control.legacy_logprobs(entries, offset) if req.logprobs is not None else None


def whole(req: ChatRequest, prompt: Prompt, result: TurnResult) -> dict:
    return {"id": "cmpl-" + secrets.token_hex(12), "object": "text_completion", "created": int(time.time()),
            "model": req.model,
            "choices": [{"index": 0, "text": _echoed(req, prompt) + result.text,
                         "logprobs": _logprobs(req, result.logprobs, len(_echoed(req, prompt))),
                         "finish_reason": FINISH_REASONS.get(result.finish.reason, "stop")}],
            "usage": usage_object(result.finish.usage)}


class _Emitter(OpenAIStream):
    object_name = "text_completion"
    field = "text"
    empty = ""

    def __init__(self, cid: str, model: str, with_usage: bool, prefix: str):
        super().__init__(cid, model, with_usage)
        self.prefix = prefix
        self.offset = len(prefix)  # characters sent so far (logprobs' text_offset)

    def start(self) -> bytes:
        return self.chunk(self.prefix) if self.prefix else b""

    def on(self, ev) -> bytes:
        if ev is KEEPALIVE:
            return sse.KEEPALIVE_COMMENT
        if isinstance(ev, Logprobs):
            out = control.legacy_logprobs(ev.entries, self.offset)
            self.offset += sum(len(e["token"]) for e in ev.entries)
            return self.chunk("", logprobs=out)
        text = getattr(ev, "text", "")
        return self.chunk(text) if text else b""
