"""HTTP helpers for the tests that talk to a frontend or a whole server without a client library:
one request (status, headers, body), waiting for /health to say a status, and the events of a
server-sent stream."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp


def http(method: str, url: str, *, body: object = None, data: bytes | None = None) -> tuple[int, dict, bytes]:
    """One raw HTTP exchange with aiohttp: (status, headers, body bytes)."""

    async def go():
        async with aiohttp.ClientSession() as session:
            kwargs = {"data": data} if data is not None else {"json": body} if body is not None else {}
            async with session.request(method, url, **kwargs) as resp:
                return resp.status, dict(resp.headers), await resp.read()

    return asyncio.run(go())


def wait_for_health(url: str, status: int, timeout: float = 30.0) -> dict:
    """Poll /health until it answers ``status`` (the fake resends EngineStats every 50 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        got, _, body = http("GET", url + "/health")
        if got == status or time.monotonic() > deadline:
            assert got == status, body
            return json.loads(body)
        time.sleep(0.02)


def sse_events(raw: bytes) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing on the way."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]
