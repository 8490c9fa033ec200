"""API errors and the two error body shapes clients parse.

Anthropic clients (Claude Code) read `{"type":"error","error":{"type","message"}}`;
OpenAI clients (the SDK, Codex) read `{"error":{"message","type","param","code"}}`.
Which shape a failure gets depends only on the request path, so even errors
raised before a body is parsed (oversized, malformed HTTP, bad auth) come back
in the shape the caller's SDK understands.
"""

from __future__ import annotations

import json
import secrets

ANTHROPIC = "anthropic"
OPENAI = "openai"

# HTTP status -> Anthropic error type (docs.claude.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# HTTP status -> OpenAI error type; the `code` field carries the finer reason.
_OPENAI_TYPES = {
    401: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request failure with the HTTP status and a message naming the problem."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind  # overrides the status-derived error type


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def family_for_path(path: str) -> str:
    """Anthropic shape for /v1/messages*, OpenAI shape for everything else."""
    p = path.rstrip("/")
    if p == "/v1/messages" or p.startswith("/v1/messages/") or p in ("/messages", "/messages/count_tokens"):
        return ANTHROPIC
    return OPENAI


def new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


def error_body(family: str, err: ApiError) -> dict:
    if family == ANTHROPIC:
        kind = err.kind or _ANTHROPIC_TYPES.get(err.status) or (
            "invalid_request_error" if err.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": err.message},
                "request_id": new_request_id()}
    kind = err.kind or _OPENAI_TYPES.get(err.status) or (
        "invalid_request_error" if err.status < 500 else "server_error")
    code = err.code
    if code is None and err.status == 401:
        code = "invalid_api_key"
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": code}}


def error_json(family: str, err: ApiError) -> bytes:
    return json.dumps(error_body(family, err), ensure_ascii=False).encode("utf-8")
