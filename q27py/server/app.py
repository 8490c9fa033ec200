"""Routing: path + method -> handler, with auth, body parsing and error shapes applied uniformly.

Every failure leaves here as a 4xx/5xx in the error shape of the API the path
belongs to (errors.family_for_path); a bug in a handler is logged and becomes
a 500 for that request only.
"""

from __future__ import annotations

import logging
import time

import trio
from typing import Awaitable, Callable

from q27py.server import anthropic, completions, dashboard, openai_chat, render_ids, responses
from q27py.server.auth import KeyRing
from q27py.server.bridge import EngineFailure
from q27py.server.errors import ApiError, error_json, family_for_path
from q27py.server.http import HttpServer, Limits, Request, Response, StreamingResponse
from q27py.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from q27py.server.params import parse_json_object
from q27py.server.request import handle, json_response
from q27py.server.service import ChatService

log = logging.getLogger("q27py.server")

Route = Callable[[ChatService, Request, dict], Awaitable["Response | StreamingResponse"]]



def _generate(api) -> Route:
    """The shared pipeline (server/request.handle) for one API module."""
    async def route(svc: ChatService, request: Request, body: dict):
        return await handle(svc, api, body)
    return route


# (path) -> (api label for metrics, POST handler taking the parsed JSON body)
POST_ROUTES: dict[str, tuple[str, Route]] = {
    "/v1/messages": ("anthropic", _generate(anthropic)),
    "/v1/messages/count_tokens": ("anthropic", anthropic.count_tokens),
    "/v1/chat/completions": ("chat", _generate(openai_chat)),
    "/v1/completions": ("completions", _generate(completions)),
    "/v1/responses": ("responses", _generate(responses)),
    **render_ids.ROUTES,  # prompt ids for prefix-aware routers (docs/DEPLOY.md)
}
GET_PATHS = ("/", "/health", "/metrics", "/v1/models") + dashboard.PATHS


class App:
    def __init__(self, service: ChatService, keys: KeyRing | None = None):
        self.service = service
        self.keys = keys or KeyRing()
        self.metrics = service.metrics
        service.bridge.observer = self.metrics  # engine-thread timing and load samples feed /metrics
        self.started = time.time()

    def http_server(self, limits: Limits | None = None) -> HttpServer:
        return HttpServer(self.handle, limits=limits, error_response=self.error_response)

    def error_response(self, path: str | None, status: int, message: str) -> Response:
        family = family_for_path(path or "/")
        return Response(status, error_json(family, ApiError(status, message)))

    async def handle(self, request: Request) -> Response | StreamingResponse:
        path = request.path.rstrip("/") or "/"
        api = POST_ROUTES[path][0] if path in POST_ROUTES else "other"
        try:
            response = await self._dispatch(request, path)
        except ApiError as err:
            response = Response(err.status, error_json(family_for_path(path), err))
        except EngineFailure as exc:
            log.error("%s %s: the engine failed: %s", request.method, path, exc)
            err = ApiError(500, "the engine failed while generating; see the server log")
            response = Response(500, error_json(family_for_path(path), err))
        self.metrics.count_request(api, response.status)
        return response

    async def _dispatch(self, request: Request, path: str) -> Response | StreamingResponse:
        method = request.method
        if path == "/health" and method in ("GET", "HEAD"):
            return json_response(200, {"status": "ok", "model": self.service.model_name})
        if path in dashboard.PUBLIC_PATHS and method == "GET":
            return dashboard.page(path)  # static page and script, no data: the JSON below needs the key
        if method == "HEAD":
            # Connection pre-warm probes (Claude Code's HEAD / and HEAD /api/hello): answer at once.
            return Response(200, b"", None)
        scrape = path == "/metrics" and method == "GET" and self.service.config.metrics_without_key
        if not scrape and not self.keys.allows(request.headers):
            presented = self.keys.presented_key(request.headers) is not None
            raise ApiError(401, "invalid API key" if presented else
                           "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
        if path in POST_ROUTES:
            if method != "POST":
                raise ApiError(405, f"{method} is not allowed on {path}; use POST")
            # Off the event loop: a 30 MB body takes seconds to parse, and /health and every
            # open stream must keep moving meanwhile (issue 13.5).
            body = await trio.to_thread.run_sync(parse_json_object, request.body,
                                                 request.header("content-encoding"))
            return await POST_ROUTES[path][1](self.service, request, body)
        if method != "GET":
            if path in GET_PATHS or path.startswith("/v1/models/"):
                raise ApiError(405, f"{method} is not allowed on {path}; use GET")
            raise ApiError(404, f"no such endpoint: {method} {request.path}")
        if path == "/":
            return json_response(200, {"status": "ok", "model": self.service.model_name,
                                       "endpoints": sorted(POST_ROUTES) + ["/v1/models", "/health", "/metrics",
                                                                         "/dashboard"]})
        if path == "/metrics":
            text = self.metrics.render(self.service.bridge.load())
            return Response(200, text.encode("utf-8"), METRICS_CONTENT_TYPE)
        if path == dashboard.DATA_PATH:
            return json_response(200, self.metrics.snapshot(self.service.bridge.load()))
        if path == "/v1/models":
            model = self._model_object(self.service.model_name)
            return json_response(200, {"object": "list", "data": [model], "has_more": False,
                                       "first_id": model["id"], "last_id": model["id"]})
        if path.startswith("/v1/models/"):
            # Any model name is accepted in requests, so any name resolves to the one model served.
            return json_response(200, self._model_object(path[len("/v1/models/"):]))
        raise ApiError(404, f"no such endpoint: GET {request.path}")

    def _model_object(self, model_id: str) -> dict:
        created = int(self.started)
        return {"id": model_id, "object": "model", "type": "model", "created": created,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                "owned_by": "q27py", "display_name": model_id,
                "max_model_len": self.service.max_context}
