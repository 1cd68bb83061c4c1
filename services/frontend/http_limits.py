"""How long, and how many, HTTP clients may hold the frontend: the limits, their flags, and the
parts that live in the application (the body-read deadline and the middleware that tells the
connection guard when a request is being handled).

The connections themselves are watched by ``connection_guard``: a request's headers must arrive
within ``header_timeout_s`` of its first byte, an idle keep-alive connection is closed after
``keepalive_timeout_s``, and a connection whose writes make no progress for ``write_timeout_s``
(a client that does not read) is cut, which cancels its handler and so aborts its request. The
body must arrive within ``body_timeout_s`` of the handler asking for it (a 408 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import dataclass
from typing import Callable

from aiohttp import web

from services.frontend.errors import APIError


@dataclass(frozen=True, kw_only=True)
class HttpLimits:
    """Per-connection deadlines (seconds) and the cap on open connections; validated on construction."""

    header_timeout_s: float = 20.0  # from a request's first byte to the end of its headers
    body_timeout_s: float = 60.0  # for the whole body, once the handler reads it
    keepalive_timeout_s: float = 75.0  # idle between requests (longer than common proxies' 60 s)
    write_timeout_s: float = 30.0  # writes blocked on a client that does not read
    max_connections: int = 4096  # more are answered 503 and closed at once

    def __post_init__(self) -> None:
        for spec in HTTP_LIMIT_FLAGS:
            value = getattr(self, spec.field)
            if spec.kind is int:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
                want = "an integer of at least 1"
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                    and value > 0
                want = "a positive number of seconds"
            if not ok:
                raise ValueError(f"{spec.flag} must be {want}, got {value!r}")


@dataclass(frozen=True)
class _FlagSpec:
    field: str  # HttpLimits' field
    kind: Callable[[str], float | int]
    help: str

    @property
    def dest(self) -> str:
        return f"http_{self.field}"

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")


HTTP_LIMIT_FLAGS = (
    _FlagSpec("header_timeout_s", float, "close a connection whose request headers are not complete this long "
                                         "after their first byte (a 408 is sent)"),
    _FlagSpec("body_timeout_s", float, "answer 408 when a request body has not fully arrived in this time"),
    _FlagSpec("keepalive_timeout_s", float, "close a connection idle between requests for this long"),
    _FlagSpec("write_timeout_s", float, "drop a client that reads nothing of its response for this long "
                                        "(its request is aborted)"),
    _FlagSpec("max_connections", int, "most open HTTP connections; more get a 503 and are closed"),
)
HTTP_LIMIT_DESTS = tuple(spec.dest for spec in HTTP_LIMIT_FLAGS)  # argparse names, for the launcher


def add_http_limit_arguments(group: argparse._ArgumentGroup) -> None:
    """The ``--http-*`` flags (default ``None``: ``HttpLimits``' own default, shown in the help)."""
    defaults = HttpLimits()
    for spec in HTTP_LIMIT_FLAGS:
        group.add_argument(spec.flag, type=spec.kind, default=None,
                           help=f"{spec.help} (default {getattr(defaults, spec.field)})")


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """``HttpLimits`` from parsed flags; flags not given keep the defaults. Raises ``ValueError``."""
    given = {spec.field: getattr(args, spec.dest, None) for spec in HTTP_LIMIT_FLAGS}
    return HttpLimits(**{name: value for name, value in given.items() if value is not None})


# ---------------------------------------------------------------- inside the application

HTTP_LIMITS = web.AppKey("http_limits", HttpLimits)
_CLOSE_AFTER = web.RequestKey("close_connection_after", bool)


async def read_body(request: web.Request) -> bytes:
    """The request's body, or a 408 when it does not arrive within ``body_timeout_s`` (the
    connection is then closed after the answer: what is left of the body is not worth reading)."""
    timeout_s = request.app[HTTP_LIMITS].body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        request[_CLOSE_AFTER] = True
        raise APIError(408, f"The request body did not arrive within {timeout_s:g} s (--http-body-timeout-s).",
                       code="request_timeout") from None


@web.middleware
async def connection_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Tell the connection guard that a request is being handled (its headers are in; the idle and
    header deadlines stop), and when it is done."""
    connection = request.protocol
    started = getattr(connection, "request_started", None)
    if started is not None:
        started()
    try:
        response = await handler(request)
        if request.get(_CLOSE_AFTER):
            response.force_close()
        return response
    finally:
        if started is not None:
            connection.request_finished(request.content.at_eof())
