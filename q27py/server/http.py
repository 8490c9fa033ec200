"""HTTP/1.1 on trio + h11: connections, keep-alive, limits, chunked streaming, graceful shutdown.

This module knows nothing about the APIs. It turns bytes into `Request`s, hands
each to an async handler and writes back a `Response` (a whole body) or a
`StreamingResponse` (an async iterator of byte chunks, sent chunked). While a
handler runs, a watcher task keeps reading the socket: EOF means the client
went away, so the handler is cancelled (its `finally` blocks cancel the
generation) instead of generating into a dead socket.
"""

from __future__ import annotations

import logging
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
        return True

    async def _watch_disconnect(self, conn: h11.Connection, stream, request: Request, scope) -> None:
        """Read while the handler runs: EOF cancels it; pipelined bytes wait for the next cycle."""
        while True:
            try:
                data = await stream.receive_some(RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            if not data:
                request.disconnected.set()
                scope.cancel()
                return
            conn.receive_data(data)
            if len(conn.trailing_data[0]) > self.limits.max_header_bytes:
                return  # enough buffered; h11 will reject it as too long on the next cycle

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
