"""OpenAI Completions: POST /v1/completions, raw text in and out (no chat template, no splitter)."""

from __future__ import annotations

import json
import secrets
import time

from q27py.server import sse
from q27py.server.errors import bad_request
from q27py.server.http import Request, Response, StreamingResponse
from q27py.server.openai_chat import FINISH_REASONS, include_usage, overflow_error, sampling_from, usage_object
from q27py.server.params import Fields
from q27py.server.service import ChatService, Prompt
from q27py.server.streaming import stream_turn
from q27py.server.turn import KEEPALIVE, Finish

DEFAULT_MAX_TOKENS = 16  # the OpenAI default for this endpoint


def _prompt(svc: ChatService, value) -> Prompt:
    """A string, a one-element list of strings, a list of token ids, or a one-element list of those."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return svc.raw_prompt(text=value)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        vocab = getattr(svc.tokenizer, "vocab_size", None)
        if any(t < 0 or (vocab is not None and t >= vocab) for t in value):
            raise bad_request("prompt: token id out of range", "prompt")
        return svc.raw_prompt(ids=value)
    if isinstance(value, list) and len(value) > 1:
        raise bad_request("prompt: only one prompt per request is supported", "prompt")
    raise bad_request("prompt: expected a string, a list of token ids, or a one-element list of either", "prompt")


prompt_of = _prompt  # also used by render_ids (POST /v1/completions/render)


async def completions(svc: ChatService, request: Request, body: dict) -> Response | StreamingResponse:
    f = Fields(body)
    model = f.string("model", required=True)
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt: field required", "prompt")
    n = f.integer("n", minimum=1)
    if (n or 1) > 1 or (f.integer("best_of", minimum=1) or 1) > 1:
        raise bad_request("n / best_of: only one completion per request is supported", "n")
    if f.present("logprobs"):
        raise bad_request("logprobs: log probabilities are not supported", "logprobs")
    if f.present("suffix"):
        raise bad_request("suffix: insertion (suffix) is not supported", "suffix")
    for key in ("presence_penalty", "frequency_penalty"):
        if f.number(key, minimum=-2, maximum=2, default=0.0) != 0.0:
            raise bad_request(f"{key}: penalties are not supported (send 0 or omit it)", key)
    echo = f.boolean("echo", False)
    stream = f.boolean("stream", False)
    requested_max = f.integer("max_tokens", minimum=1, default=DEFAULT_MAX_TOKENS)
    sampling = sampling_from(svc, f)
    stops = f.stop_list("stop")
    prompt = _prompt(svc, body["prompt"])
    svc.check_context(prompt, lambda n_, limit: overflow_error(n_, limit, "prompt"))
    max_tokens = svc.max_tokens(requested_max, prompt)
    plan = svc.plan(prompt, conv=None, max_tokens=max_tokens, sampling=sampling, stop_sequences=stops)
    cid = "cmpl-" + secrets.token_hex(12)
    prefix = (prompt.text or svc.tokenizer.decode(prompt.ids)) if echo else ""
    if stream:
        emitter = _Emitter(cid, model, include_usage(f), prefix)
        return StreamingResponse(200, stream_turn(svc, plan, emitter))
    result = await svc.collect(plan)
    payload = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
               "choices": [{"index": 0, "text": prefix + result.text, "logprobs": None,
                            "finish_reason": FINISH_REASONS.get(result.finish.reason, "stop")}],
               "usage": usage_object(result.finish.usage)}
    return Response(200, json.dumps(payload, ensure_ascii=False).encode())


class _Emitter:
    def __init__(self, cid: str, model: str, with_usage: bool, prefix: str):
        self.cid = cid
        self.model = model
        self.with_usage = with_usage
        self.prefix = prefix
        self.created = int(time.time())

    def chunk(self, text: str, finish_reason: str | None = None) -> bytes:
        payload = {"id": self.cid, "object": "text_completion", "created": self.created, "model": self.model,
                   "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
        if self.with_usage:
            payload["usage"] = None
        return sse.data(payload)

    def start(self) -> bytes:
        return self.chunk(self.prefix) if self.prefix else b""

    def on(self, ev) -> bytes:
        if ev is KEEPALIVE:
            return sse.KEEPALIVE_COMMENT
        text = getattr(ev, "text", "")
        return self.chunk(text) if text else b""

    def finish(self, finish: Finish) -> bytes:
        out = self.chunk("", FINISH_REASONS.get(finish.reason, "stop"))
        if self.with_usage:
            out += sse.data({"id": self.cid, "object": "text_completion", "created": self.created,
                             "model": self.model, "choices": [], "usage": usage_object(finish.usage)})
        return out + sse.DONE

    def failure(self, message: str) -> bytes:
        return sse.data({"error": {"message": message, "type": "server_error", "param": None,
                                   "code": None}}) + sse.DONE
