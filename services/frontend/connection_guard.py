"""The connection guard: closes HTTP connections that hold the frontend without making progress.

aiohttp offers an idle keep-alive timeout, but not a deadline on a request's headers (a client
sending one header byte every few seconds holds its connection for ever), nor on writes (a client
that never reads holds its handler, and its engine request, for ever), nor a cap on connections.
``GuardedHandler`` is aiohttp's ``RequestHandler`` with the bookkeeping for those (when a request's
first byte came, whether a handler is running, since when writes have been blocked);
``ConnectionGuard`` admits connections up to the cap and, every ``tick_s``, closes those past a
deadline of ``HttpLimits``:

- idle (no handler running, no byte of a next request, nothing left to write) for
  ``keepalive_timeout_s``: closed;
- a request's headers not complete ``header_timeout_s`` after its first byte: answered 408, closed;
- writing blocked (the transport paused us: the client reads nothing) for ``write_timeout_s``:
  the transport is aborted (``close`` would wait for the unread buffer), which cancels the
  handler (``handler_cancellation``) and so aborts its request at the scheduler.

"Handler running" is reported by ``http_limits.connection_middleware``. ``GuardedSite`` listens
with these handlers in place of ``web.TCPSite``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import resource
import time
from typing import Any

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from services.frontend.flags import HttpLimits

log = structlog.get_logger()

_FD_MARGIN = 128  # file descriptors kept for everything but client connections


def _raw_response(status: str, message: str, extra_headers: str = "") -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error" if status[0] == "5" else
                                 "invalid_request_error", "param": None, "code": None}}).encode()
    head = (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra_headers}Connection: close\r\n\r\n")
    return head.encode() + body


class GuardedHandler(RequestHandler):
    """aiohttp's connection handler, plus what ``ConnectionGuard`` needs to judge it."""

    __slots__ = ("_guard", "idle_since", "first_byte_at", "in_handler", "draining", "write_paused_at")

    def __init__(self, manager: web.Server, guard: "ConnectionGuard", **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self.idle_since = time.monotonic()  # when it last became idle (connected, or a handler ended)
        self.first_byte_at: float | None = None  # first byte of a request whose handler has not started
        self.in_handler = False
        self.draining = False  # aiohttp is reading (and dropping) the rest of a body its handler left
        self.write_paused_at: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self._guard.admit(self):
            transport.write(self._guard.refusal)
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._guard.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and not self.in_handler and not self.draining and self.first_byte_at is None:
            self.first_byte_at = time.monotonic()
        super().data_received(data)

    def pause_writing(self) -> None:
        self.write_paused_at = time.monotonic()
        super().pause_writing()

    def resume_writing(self) -> None:
        self.write_paused_at = None
        super().resume_writing()

    def request_started(self) -> None:
        self.in_handler = True
        self.draining = False
        self.first_byte_at = None

    def request_finished(self, body_read: bool) -> None:
        """The handler returned; ``body_read``: it consumed the whole body (else what follows is the
        rest of that body, which aiohttp drains for a while, not the start of a next request)."""
        self.in_handler = False
        self.draining = not body_read
        self.idle_since = time.monotonic()

    def overdue(self, now: float, limits: HttpLimits) -> str | None:
        """Which deadline this connection has passed at ``now``: "write", "header", "idle" or None."""
        if self.write_paused_at is not None and now - self.write_paused_at > limits.write_timeout_s:
            return "write"
        if self.in_handler:
            return None
        if self.first_byte_at is not None:
            return "header" if now - self.first_byte_at > limits.header_timeout_s else None
        transport = self.transport
        if transport is not None and transport.get_write_buffer_size():
            return None  # a response is still being written: the write deadline covers it
        return "idle" if now - self.idle_since > limits.keepalive_timeout_s else None


class ConnectionGuard:
    """Admits up to ``limits.max_connections`` connections and closes overdue ones (see the module
    docstring). Run ``watch()`` as a task while the server listens."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.max_connections = _fit_fd_limit(limits.max_connections)
        self.refusal = _raw_response(
            "503 Service Unavailable",
            f"The server has {self.max_connections} connections open, its limit (--http-max-connections); "
            f"retry later.", "Retry-After: 1\r\n")
        self._header_timeout = _raw_response(
            "408 Request Timeout",
            f"The request headers did not arrive within {limits.header_timeout_s:g} s (--http-header-timeout-s).")
        self._connections: set[GuardedHandler] = set()
        self.num_refused = 0
        self.num_closed: collections.Counter[str] = collections.Counter()  # by reason
        shortest = min(limits.header_timeout_s, limits.keepalive_timeout_s, limits.write_timeout_s)
        self.tick_s = min(1.0, max(0.05, shortest / 4))

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    def handler_factory(self, server: web.Server, **handler_kwargs: Any):
        """The protocol factory for ``loop.create_server``."""
        return lambda: GuardedHandler(server, self, **handler_kwargs)

    def admit(self, connection: GuardedHandler) -> bool:
        if len(self._connections) >= self.max_connections:
            self.num_refused += 1
            log.warning("connection refused: too many open", max_connections=self.max_connections)
            return False
        self._connections.add(connection)
        return True

    def forget(self, connection: GuardedHandler) -> None:
        self._connections.discard(connection)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        """Close every connection past a deadline at ``now``."""
        closed: collections.Counter[str] = collections.Counter()
        for connection in list(self._connections):
            reason = connection.overdue(now, self.limits)
            if reason is None or connection.transport is None:
                continue
            closed[reason] += 1
            self._connections.discard(connection)
            if reason == "write":
                connection.transport.abort()  # close() would wait for the client to read the buffer
            else:
                if reason == "header":
                    connection.transport.write(self._header_timeout)
                connection.force_close()
        if closed:
            self.num_closed.update(closed)
            log.info("closed slow connections", **{f"num_{reason}": n for reason, n in closed.items()},
                     num_open=len(self._connections))


def _fit_fd_limit(max_connections: int) -> int:
    """Raise this process's soft limit on open files toward ``max_connections`` (plus a margin) if
    the hard limit allows; if it cannot, serve fewer connections rather than fail ``accept``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + _FD_MARGIN
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fitted = max(1, soft - _FD_MARGIN)
        log.warning("fewer connections than --http-max-connections: the open-file limit is too low",
                    max_connections=max_connections, num_connections=fitted, open_file_limit=soft)
        return fitted
    return max_connections


class GuardedSite(web.BaseSite):
    """``web.TCPSite`` whose connections are ``GuardedHandler``s of ``guard``. ``handler_kwargs`` go
    to aiohttp's ``RequestHandler`` (``access_log``...). aiohttp's own keep-alive timer stays on as
    a backstop, past the guard's deadlines: started at the last response, it would otherwise cut a
    request whose headers began just before the idle deadline."""

    __slots__ = ("_host", "_port", "_guard", "_handler_kwargs")

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard,
                 **handler_kwargs: Any) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._guard = guard
        self._handler_kwargs = handler_kwargs

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None, "call runner.setup() first"
        limits = self._guard.limits
        backstop_s = limits.keepalive_timeout_s + limits.header_timeout_s
        factory = self._guard.handler_factory(server, loop=loop, **{"keepalive_timeout": backstop_s,
                                                                    **self._handler_kwargs})
        self._server = await loop.create_server(factory, self._host, self._port, backlog=self._backlog,
                                                reuse_address=True)
