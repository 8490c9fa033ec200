"""POST <api path>/render: the prompt token ids a request would run with, without running it.

Routers that place requests by prompt prefix (vllm-router's cache_aware policy,
docs/DEPLOY.md) first ask a replica to render the request into token ids, the
way vLLM's render endpoints answer: `{"token_ids": [...]}`. Without these
endpoints vllm-router 0.1.17 has no prefix to match and sends every request to
one replica. The ids are exactly the ones the generation endpoint would use
(same conversation mapping, thinking policy and split encoding at the stable
boundary), so the router's prefix tree mirrors the replicas' prefix caches.
"""

from __future__ import annotations

import json

from q27py.server import anthropic, completions
from q27py.server.errors import bad_request
from q27py.server.http import Request, Response
from q27py.server.params import Fields
from q27py.server.service import ChatService, Prompt


def _answer(kind: str, body: dict, prompt: Prompt) -> Response:
    payload = {"schema_version": 1, "kind": kind, "model": body.get("model"), "token_ids": prompt.ids,
               "prompt_tokens": len(prompt.ids)}
    return Response(200, json.dumps(payload).encode())


def _chat_like(api: str, kind: str):
    async def render(svc: ChatService, request: Request, body: dict) -> Response:
        Fields(body).string("model", required=True)
        conv, opts = svc.conversation(api, body)
        return _answer(kind, body, svc.render(conv, thinking=opts.enable_thinking,
                                              preserve_thinking=opts.preserve_thinking))
    return render


async def messages_render(svc: ChatService, request: Request, body: dict) -> Response:
    return _answer("messages", body, anthropic.prepare(svc, body)[3])


async def completions_render(svc: ChatService, request: Request, body: dict) -> Response:
    Fields(body).string("model", required=True)
    if body.get("prompt") is None:
        raise bad_request("prompt: field required", "prompt")
    return _answer("completion", body, completions.prompt_of(svc, body["prompt"]))


ROUTES = {
    "/v1/chat/completions/render": ("render", _chat_like("openai", "chat")),
    "/v1/responses/render": ("render", _chat_like("responses", "responses")),
    "/v1/messages/render": ("render", messages_render),
    "/v1/completions/render": ("render", completions_render),
}
