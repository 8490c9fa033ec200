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

import trio

from q27py.server import anthropic, completions, openai_chat, responses
from q27py.server.http import Request, Response
from q27py.server.request import build_prompt
from q27py.server.service import ChatService


def _render(kind: str, api):
    """The generation pipeline's first two steps (server/request.handle): the API module's own
    reader, then the same prompt step -- so these ids are exactly the ones a generation would run."""
    async def render(svc: ChatService, request: Request, body: dict) -> Response:
        def prepare():
            return build_prompt(svc, api.read(body))

        prompt = await trio.to_thread.run_sync(prepare)  # off the event loop, as generation is
        payload = {"schema_version": 1, "kind": kind, "model": body.get("model"), "token_ids": prompt.ids,
                   "prompt_tokens": len(prompt.ids)}
        return Response(200, json.dumps(payload).encode())
    return render


ROUTES = {
    "/v1/chat/completions/render": ("render", _render("chat", openai_chat)),
    "/v1/responses/render": ("render", _render("responses", responses)),
    "/v1/messages/render": ("render", _render("messages", anthropic)),
    "/v1/completions/render": ("render", _render("completion", completions)),
}
