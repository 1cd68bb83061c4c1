"""How long, and how many, HTTP clients may hold the frontend: the parts that live in the
application (the body-read deadline and the middleware that tells the connection guard when a
request is being handled). The limits and their flags are in ``flags``.

The connections themselves are watched by ``connection_guard``: a request's headers must arrive
within ``header_timeout_s`` of its first byte, an idle keep-alive connection is closed after
``keepalive_timeout_s``, and a connection whose writes make no progress for ``write_timeout_s``
(a client that does not read) is cut, which cancels its handler and so aborts its request. The
body must arrive within ``body_timeout_s`` of the handler asking for it (a 408 otherwise).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from aiohttp import web

from services.frontend.errors import APIError
from services.frontend.flags import HttpLimits


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
