"""Test-only helpers: a live server in a background thread, raw HTTP exchanges, a server factory.

Nothing here is importable from the q27py package: the scripted engine that
drives the model side in tests (scripted_engine.py) is not a serving mode.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import trio

from q27py.config import ServerConfig
from q27py.server.http import HttpServer, Limits
from scripted_engine import ScriptedEngine

HOST = "127.0.0.1"  # tests never bind anything else


class LiveServer:
    """Runs an HttpServer (or an App, which has .http_server and .run hooks) in its own trio thread."""

    def __init__(self, server: HttpServer, on_start=None, on_stop=None):
        self.server = server
        self.port = 0
        self._on_start = on_start
        self._on_stop = on_stop
        self._ready = threading.Event()
        self._token = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # surfaced by __exit__
            self.error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        if self._on_start:
            self._on_start()
        try:
            async with trio.open_nursery() as nursery:
                self.port = await nursery.start(self.server.serve, HOST, 0)
                self._ready.set()
        finally:
            if self._on_stop:
                self._on_stop()

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        self._ready.wait(10)
        if self.error:
            raise self.error
        return self

    def stop(self, join_timeout: float = 15.0) -> None:
        if self._token is not None and self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self.server.shutdown, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(join_timeout)

    def __exit__(self, *exc) -> None:
        self.stop()
        if self.error:
            raise self.error

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def raw_exchange(port: int, data: bytes, *, timeout: float = 5.0, half_close: bool = False) -> bytes:
    """Send raw bytes, read until the server closes (or timeout)."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        out = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                part = sock.recv(65536)
            except socket.timeout:
                break
            except ConnectionResetError:
                break
            if not part:
                break
            out += part
        return out


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Parse one HTTP/1.1 response (Content-Length or chunked)."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        return status, headers, rest[: int(headers["content-length"])]
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            body += rest[:size]
            rest = rest[size + 2:]
        return status, headers, body
    return status, headers, rest


def http_request(port: int, method: str, path: str, body=None, headers: dict | None = None,
                 timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection (Connection: close)."""
    if body is None:
        payload = b""
    elif isinstance(body, (bytes, bytearray)):
        payload = bytes(body)
    else:
        payload = json.dumps(body).encode()
    hdrs = {"Host": f"{HOST}:{port}", "Connection": "close", "Content-Length": str(len(payload))}
    if payload and not isinstance(body, (bytes, bytearray)):
        hdrs["Content-Type"] = "application/json"
    hdrs.update(headers or {})
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
    raw = raw_exchange(port, head.encode("latin-1") + payload, timeout=timeout)
    return parse_response(raw)


def sse_events(body: bytes) -> list[tuple[str | None, str]]:
    """Split an SSE body into (event name or None, data) pairs; comments are dropped."""
    events = []
    for block in body.decode("utf-8").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        if data:
            events.append((name, "\n".join(data)))
    return events


def fast_limits(**overrides) -> Limits:
    values = dict(header_timeout_s=1.0, body_timeout_s=1.0, shutdown_grace_s=2.0, max_body_bytes=1 << 20)
    values.update(overrides)
    return Limits(**values)


def default_script(prompt: str) -> str:
    return "Hello from the scripted model."


class ServerFactory:
    """Builds live servers around a ScriptedEngine: (script, keys, limits, ServerConfig fields,
    ScriptedEngine timing knobs) -> LiveServer with .app and .engine."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.live: list[LiveServer] = []

    def __call__(self, script=default_script, *, keys=(), max_context=8192, ping_interval_s=10.0,
                 limits=None, **overrides):
        from q27py.server.app import App
        from q27py.server.auth import KeyRing
        from q27py.server.bridge import EngineBridge
        from q27py.server.service import ChatService

        engine_opts = {k: overrides.pop(k) for k in list(overrides)
                       if k in ("tokens_per_chunk", "prefill_delay_s", "token_delay_s", "cached_tokens", "max_slots")}
        config = ServerConfig(**overrides)
        engine = ScriptedEngine(self.tokenizer, script, frozenset(self.tokenizer.eos_ids),
                                max_context=max_context, **engine_opts)
        bridge = EngineBridge(engine)
        service = ChatService(bridge, self.tokenizer, model_name=engine.model_name, template="qwen3.6",
                              stop_ids=self.tokenizer.eos_ids, config=config, ping_interval_s=ping_interval_s)
        app = App(service, KeyRing(list(keys)))
        live = LiveServer(app.http_server(limits or fast_limits()), on_start=bridge.start, on_stop=bridge.stop)
        live.app = app
        live.engine = engine
        live.__enter__()
        self.live.append(live)
        return live

    def close(self):
        for live in self.live:
            live.stop()
