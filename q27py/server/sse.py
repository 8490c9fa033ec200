"""Server-sent event framing: `event:` + `data:` lines (Anthropic, Responses) or `data:` only (OpenAI Chat)."""

from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"
KEEPALIVE_COMMENT = b": keep-alive\n\n"  # ignored by SSE parsers; keeps proxies and sockets warm


def dumps(payload) -> str:
    # JSON escapes newlines inside strings, so one payload is always one `data:` line.
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def event(name: str, payload: dict) -> bytes:
    return f"event: {name}\ndata: {dumps(payload)}\n\n".encode("utf-8")


def data(payload: dict) -> bytes:
    return f"data: {dumps(payload)}\n\n".encode("utf-8")
