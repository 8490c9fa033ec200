"""HTTP/1.1 on trio + h11: connections, keep-alive, limits, chunked streaming, graceful shutdown.

This module knows nothing about the APIs. It turns bytes into `Request`s, hands
each to an async handler and writes back a `Response` (a whole body) or a
`StreamingResponse` (an async iterator of byte chunks, sent chunked). While a
handler runs, a watcher task keeps reading the socket: EOF means the client
went away, so the handler is cancelled (its `finally` blocks cancel the
generation) instead of generating into a dead socket -- unless the client only
half-closed (shut down its sending side and waits for the answer, as `nc -N` and some
scripted clients do): before the answer has started, EOF is followed by a probe (an
interim `100 Continue`, which every HTTP/1.1 client must accept), and only a client whose
socket then refuses bytes counts as gone; a half-closed one gets its answer, then the
connection closes.

Framing rules beyond h11's: a request with both Content-Length and Transfer-Encoding is
refused (400) and the connection closed (RFC 9112 section 6.1: the smuggling vector); the
request line + headers limit counts the whole head, however the bytes arrived; only
HTTP/1.0 and 1.1 are served (anything else, such as an HTTP/2 preface, is a 505).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable
from urllib.parse import parse_qsl, urlsplit

import h11
import trio

log = logging.getLogger("q27py.server")

RECEIVE_SIZE = 64 * 1024


@dataclass
class Limits:
    max_header_bytes: int = 64 * 1024  # request line + headers
    max_body_bytes: int = 32 << 20
    header_timeout_s: float = 30.0  # a request head must arrive within this (also the keep-alive idle limit)
    body_timeout_s: float = 120.0  # the whole body must arrive within this
    shutdown_grace_s: float = 10.0  # in-flight requests get this long to finish on shutdown


@dataclass
class Request:
    method: str
    target: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes
    client: str = ""
    disconnected: trio.Event = field(default_factory=trio.Event)
    half_closed: bool = False  # the client shut down its sending side; it still reads the answer

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name.lower(), default)


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str | None = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class StreamingResponse:
    status: int
    chunks: AsyncIterator[bytes]
    content_type: str = "text/event-stream"
    headers: list[tuple[str, str]] = field(default_factory=list)


Handler = Callable[[Request], Awaitable["Response | StreamingResponse"]]
# (path or None when the request line was unreadable, status, message) -> Response in the API's shape
ErrorResponder = Callable[["str | None", int, str], Response]


def plain_error(path: str | None, status: int, message: str) -> Response:
    return Response(status, message.encode() + b"\n", "text/plain; charset=utf-8")


def _declared_length(value: str | None) -> int | None:
    """Content-Length as h11 accepted it (it already rejected malformed or conflicting values)."""
    try:
        return int(value.split(",")[0]) if value else None
    except ValueError:
        return None


class _ClientGone(Exception):
    """The peer closed or reset the connection."""


class _Stream:
    """A socket stream whose writes are serialized: the disconnect watcher's probe and the
    handler's answer may both write, and their bytes must never interleave."""

    def __init__(self, stream):
        self.raw = stream
        self.socket = stream.socket
        self.lock = trio.Lock()

    async def send_all(self, data: bytes) -> None:
        async with self.lock:
            await self.raw.send_all(data)

    async def receive_some(self, max_bytes: int) -> bytes:
        return await self.raw.receive_some(max_bytes)

    async def send_eof(self) -> None:
        async with self.lock:
            await self.raw.send_eof()

    async def aclose(self) -> None:
        await self.raw.aclose()


TCP_CLOSE_WAIT = 8  # linux/tcp_states.h: the peer sent FIN, we have not closed


def _tcp_state(sock) -> int | None:
    """The kernel's TCP state of a socket (Linux TCP_INFO), None where unavailable."""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except (AttributeError, OSError, IndexError):
        return None


def _head_size(event: h11.Request) -> int:
    """Bytes of the request line and headers as sent (h11 only bounds what it buffers at once)."""
    line = len(event.method) + len(event.target) + len(b" HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in event.headers.raw_items()) + 2


class HttpServer:
    def __init__(self, handler: Handler, *, limits: Limits | None = None,
                 error_response: ErrorResponder = plain_error, server_name: str = "q27py"):
        self.handler = handler
        self.limits = limits or Limits()
        self.error_response = error_response
        self.server_name = server_name.encode()
        self.bound: list[tuple[str, int]] = []
        self._shutdown = trio.Event()
        self._draining = False
        self._busy = 0  # connections with a request in flight

    # ---- lifecycle -------------------------------------------------------

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen until `shutdown()`, then drain in-flight requests and return."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        self.bound = [ls.socket.getsockname()[:2] for ls in listeners]
        async with trio.open_nursery() as connections:
            accept_scope = trio.CancelScope()

            async def accept() -> None:
                with accept_scope:
                    await trio.serve_listeners(self._connection, listeners, handler_nursery=connections)

            connections.start_soon(accept)
            task_status.started(self.bound[0][1])
            await self._shutdown.wait()
            accept_scope.cancel()
            with trio.move_on_after(self.limits.shutdown_grace_s):
                while self._busy:
                    await trio.sleep(0.05)
            if self._busy:
                log.warning("shutdown: cancelling %d request(s) still running after %.0fs",
                            self._busy, self.limits.shutdown_grace_s)
            connections.cancel_scope.cancel()

    @property
    def draining(self) -> bool:
        return self._draining

    def shutdown(self) -> None:
        """Stop accepting; idle keep-alive connections close, busy ones finish (up to the grace)."""
        self._draining = True
        self._shutdown.set()

    # ---- one connection --------------------------------------------------

    async def _connection(self, stream: trio.SocketStream) -> None:
        stream = _Stream(stream)
        try:
            peer = stream.socket.getpeername()
            client = f"{peer[0]}:{peer[1]}"
        except OSError:
            client = "?"
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        try:
            while not self._draining or conn.trailing_data[0]:
                keep_going = await self._one_exchange(conn, stream, client)
                if not keep_going or self._draining:
                    break
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    break
                conn.start_next_cycle()
        except _ClientGone:
            pass
        except Exception:  # a bug must cost one connection, never the server
            log.exception("connection %s: unexpected error", client)
        finally:
            await self._close(stream, conn)

    async def _one_exchange(self, conn: h11.Connection, stream, client: str) -> bool:
        """Read one request, answer it. Returns False when the connection must close."""
        limits = self.limits
        try:
            with trio.fail_after(limits.header_timeout_s):
                event = await self._next_event(conn, stream)
        except trio.TooSlowError:
            if conn.trailing_data[0]:  # a partial request head: tell the slow client why
                await self._send_error(conn, stream, None, 408, "request headers not received in time")
            return False
        except h11.RemoteProtocolError as exc:
            await self._send_error(conn, stream, None, exc.error_status_hint, f"malformed HTTP request: {exc}")
            return False
        if isinstance(event, h11.ConnectionClosed):
            return False
        assert isinstance(event, h11.Request), event

        target = event.target.decode("latin-1")
        split = urlsplit(target)
        path = split.path or "/"
        headers: dict[str, str] = {}
        for name, value in event.headers:
            key = name.decode("latin-1").lower()
            val = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {val}" if key in headers else val
        method = event.method.decode("latin-1").upper()

        if event.http_version not in (b"1.0", b"1.1"):
            version = event.http_version.decode("latin-1")
            await self._send_error(conn, stream, path, 505, f"HTTP/{version} is not supported (HTTP/1.1 only)")
            return False
        if _head_size(event) > limits.max_header_bytes:
            await self._send_error(conn, stream, path, 431, f"request headers exceed the "
                                   f"{limits.max_header_bytes}-byte limit")
            return False
        if "transfer-encoding" in headers and "content-length" in headers:
            await self._send_error(conn, stream, path, 400, "a request may not carry both Content-Length "
                                   "and Transfer-Encoding")
            return False

        declared = _declared_length(headers.get("content-length"))
        if declared is not None and declared > limits.max_body_bytes:
            await self._send_error(conn, stream, path, 413, f"request body of {declared} bytes exceeds "
                                   f"the {limits.max_body_bytes}-byte limit")
            return False
        body = bytearray()
        try:
            with trio.fail_after(limits.body_timeout_s):
                if conn.they_are_waiting_for_100_continue:
                    await self._send(stream, conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                while True:
                    ev = await self._next_event(conn, stream)
                    if isinstance(ev, h11.Data):
                        body += ev.data
                        if len(body) > limits.max_body_bytes:
                            await self._send_error(conn, stream, path, 413,
                                                   f"request body exceeds the {limits.max_body_bytes}-byte limit")
                            return False
                    elif isinstance(ev, h11.EndOfMessage):
                        break
                    elif isinstance(ev, h11.ConnectionClosed):
                        return False
        except trio.TooSlowError:
            await self._send_error(conn, stream, path, 408, "request body not received in time")
            return False
        except h11.RemoteProtocolError as exc:
            await self._send_error(conn, stream, path, exc.error_status_hint, f"malformed HTTP request: {exc}")
            return False

        request = Request(method=method, target=target, path=path,
                          query=dict(parse_qsl(split.query, keep_blank_values=True)),
                          headers=headers, body=bytes(body), client=client)
        self._busy += 1
        try:
            return await self._respond(conn, stream, request)
        finally:
            self._busy -= 1

    async def _respond(self, conn: h11.Connection, stream, request: Request) -> bool:
        started = time.monotonic()
        status = 0
        completed = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_disconnect, conn, stream, request, nursery.cancel_scope)
            try:
                try:
                    response = await self.handler(request)
                except Exception:
                    log.exception("%s %s: handler failed", request.method, request.path)
                    response = self.error_response(request.path, 500, "internal server error")
                status = response.status
                if isinstance(response, StreamingResponse):
                    await self._send_streaming(conn, stream, request, response)
                else:
                    await self._send_whole(conn, stream, request, response)
                completed = True
            except _ClientGone:
                request.disconnected.set()
            finally:
                nursery.cancel_scope.cancel()  # stop the watcher
        elapsed = (time.monotonic() - started) * 1000
        if not completed or request.disconnected.is_set():
            log.info("%s %s %s -> client disconnected after %.0f ms", request.client, request.method,
                     request.target, elapsed)
            return False
        log.info("%s %s %s -> %d (%.0f ms)", request.client, request.method, request.target, status, elapsed)
        return not request.half_closed  # a half-closed client sends nothing more: close after the answer

    async def _watch_disconnect(self, conn: h11.Connection, stream, request: Request, scope) -> None:
        """Read while the handler runs: EOF cancels it; pipelined bytes wait for the next cycle."""
        while True:
            try:
                data = await stream.receive_some(RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            if not data:
                if await self._still_listening(conn, stream):
                    request.half_closed = True  # answer it; nothing more will be read
                    return
                request.disconnected.set()
                scope.cancel()
                return
            conn.receive_data(data)
            if len(conn.trailing_data[0]) > self.limits.max_header_bytes:
                return  # enough buffered; h11 will reject it as too long on the next cycle

    async def _still_listening(self, conn: h11.Connection, stream: _Stream) -> bool:
        """After EOF: is this a half-close (the client still reads) or a client that went away?

        Only a write can tell: a closed socket answers the first one with a reset, which fails
        the second. The probe is an interim 100 Continue, sent only while the final answer has
        not started. Once it has, its own bytes were the probe: a reset since then shows in the
        kernel's TCP state (Linux); a socket still in CLOSE_WAIT is read as a half-close, and
        if the client is in fact gone the next writes of the stream fail and end it."""
        for _ in range(2):
            async with stream.lock:
                if conn.our_state is not h11.SEND_RESPONSE:
                    await trio.sleep(0.05)
                    return _tcp_state(stream.socket) == TCP_CLOSE_WAIT
                if conn.their_http_version != b"1.1":
                    return False  # no interim responses to HTTP/1.0 clients (RFC 9110 15.2): EOF = gone
                try:
                    probe = conn.send(h11.InformationalResponse(status_code=100, headers=[]))
                except h11.LocalProtocolError:
                    return False
                try:
                    await stream.raw.send_all(probe)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    return False
            await trio.sleep(0.05)
        return True

    # ---- writing ---------------------------------------------------------

    def _headers(self, content_type: str | None, extra: list[tuple[str, str]],
                 length: int | None) -> list[tuple[bytes, bytes]]:
        out = [(b"server", self.server_name)]
        if content_type:
            out.append((b"content-type", content_type.encode("latin-1")))
        if length is not None:
            out.append((b"content-length", str(length).encode()))
        for name, value in extra:
            out.append((name.encode("latin-1"), value.encode("latin-1")))
        if self._draining:
            out.append((b"connection", b"close"))
        return out

    async def _send_whole(self, conn, stream, request: Request, response: Response) -> None:
        headers = self._headers(response.content_type, response.headers, len(response.body))
        await self._send(stream, conn.send(h11.Response(status_code=response.status, headers=headers)))
        if response.body and request.method != "HEAD":
            await self._send(stream, conn.send(h11.Data(data=response.body)))
        await self._send(stream, conn.send(h11.EndOfMessage()))

    async def _send_streaming(self, conn, stream, request: Request, response: StreamingResponse) -> None:
        chunks = response.chunks
        try:
            extra = [("cache-control", "no-cache"), ("x-accel-buffering", "no")] + response.headers
            headers = self._headers(response.content_type, extra, None)
            await self._send(stream, conn.send(h11.Response(status_code=response.status, headers=headers)))
            async for chunk in chunks:
                if chunk and request.method != "HEAD":
                    await self._send(stream, conn.send(h11.Data(data=chunk)))
            await self._send(stream, conn.send(h11.EndOfMessage()))
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()

    async def _send(self, stream, data: bytes | None) -> None:
        if not data:
            return
        try:
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _ClientGone() from exc

    async def _send_error(self, conn: h11.Connection, stream, path: str | None, status: int, message: str) -> None:
        """Best-effort error answer on a connection that will close afterwards."""
        if conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        response = self.error_response(path, status, message)
        extra = list(response.headers) + [("connection", "close")]
        try:
            headers = self._headers(response.content_type, extra, len(response.body))
            await self._send(stream, conn.send(h11.Response(status_code=status, headers=headers)))
            await self._send(stream, conn.send(h11.Data(data=response.body)))
            await self._send(stream, conn.send(h11.EndOfMessage()))
        except (h11.LocalProtocolError, _ClientGone):
            pass
        log.info("HTTP %d: %s", status, message)

    # ---- reading / closing -----------------------------------------------

    async def _next_event(self, conn: h11.Connection, stream):
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await stream.receive_some(RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            conn.receive_data(data)

    async def _close(self, stream, conn: h11.Connection) -> None:
        """Close. If the peer may still be sending (we answered an error mid-request), half-close
        and drain briefly first, so the error is not lost to a TCP reset."""
        with trio.CancelScope(shield=True):
            if conn.their_state not in (h11.IDLE, h11.DONE, h11.MUST_CLOSE, h11.CLOSED):
                with trio.move_on_after(0.5):
                    try:
                        await stream.send_eof()
                        while await stream.receive_some(RECEIVE_SIZE):
                            pass
                    except Exception:
                        pass
            try:
                await stream.aclose()
            except Exception:
                pass
