"""A request's streamed chunks (completions' or chat's), as dicts, in the order they are sent;
and the route's way of sending them: server-sent events ending with ``[DONE]``. Other answers
built on chat (the Responses API, ``responses_stream``) read the same chunks.

Beam search choices open with their text (how many come back is known only at the end); an echo
with logprobs waits for the prompt's, which come with the request's first output. An engine error
ends the chunks with the error's body (``{"error": ...}``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import structlog
from aiohttp import web

from services.frontend.errors import APIError
from services.frontend.generation import Delta, EngineRequestError, Generation
from services.frontend.responses import ResponseShapes

log = structlog.get_logger()

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def api_error(exc: EngineRequestError) -> APIError:
    return APIError(exc.status, exc.message, "invalid_request_error" if exc.status < 500 else "server_error")


async def write_sse(request: web.Request, chunks: AsyncIterator[dict[str, Any]],
                    shapes: ResponseShapes) -> web.StreamResponse:
    """Each chunk as the shapes' server-sent event (OpenAI's, or Anthropic's named events), an
    engine error (a chunk of only ``error``) as their error event, then what ends their stream
    (OpenAI's ``[DONE]``)."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        async with contextlib.aclosing(chunks):  # a client gone: the generations close now
            async for chunk in chunks:
                await response.write(shapes.error_event(_error_of(chunk)) if set(chunk) == {"error"}
                                     else shapes.event(chunk))
        await response.write(shapes.done())
        await response.write_eof()
    except ConnectionResetError:
        log.info("client disconnected mid-stream")
    return response


def _error_of(chunk: dict[str, Any]) -> APIError:
    """The ``APIError`` back from its body (``api_error(...).to_dict()``)."""
    e = chunk["error"]
    return APIError(500 if e.get("type") == "server_error" else 400, e.get("message", ""), e.get("type"),
                    e.get("param"), e.get("code"))


async def stream_chunks(gens: list[Generation], shapes: ResponseShapes, echoes: list[Any],
                        usage_of: Any) -> AsyncIterator[dict[str, Any]]:
    """Every chunk of the request; ``echoes`` (``serving._Echo``) per generation; ``usage_of(gens)``
    the usage for the last chunk (with ``include_usage``)."""
    echo_of = {c.index: (gen, echo) for gen, echo in zip(gens, echoes) for c in gen.choices}
    opened: set[int] = set()

    def open_choices(indices: list[int]) -> list[dict[str, Any]]:
        """A choice's opening chunk (chat's role), then its echoed prompt."""
        out = shapes.opening_chunks(indices)
        for index in indices:
            gen, echo = echo_of[index]
            if echo.text or echo.num_top is not None:
                out.append(shapes.chunk(index, echo.text, None, echo.logprobs(gen)))
        opened.update(indices)
        return out

    for chunk in open_choices([c.index for g, e in zip(gens, echoes) if not g.beam_search and e.num_top is None
                               for c in g.choices]):
        yield chunk
    try:
        async with contextlib.aclosing(_deltas(gens)) as deltas:
            async for gen, delta in deltas:
                out = open_choices([delta.index]) if delta.index not in opened else []
                if delta.text or delta.finish_reason is not None or delta.logprobs:
                    logprobs = delta.logprobs if gen.wants_logprobs else None
                    out += shapes.chunks(delta.index, delta.text, delta.finish_reason, logprobs)
                for chunk in out:
                    yield chunk
        stop_strings = {c.index: c.stop_string for g in gens for c in g.choices}
        for chunk in shapes.closing_chunks(usage_of(gens), stop_strings):
            yield chunk
    except EngineRequestError as exc:
        yield api_error(exc).to_dict()


async def _deltas(gens: list[Generation]) -> AsyncIterator[tuple[Generation, Delta]]:
    """Every delta of every generation, as each arrives, until all have finished."""
    if len(gens) == 1:
        gen = gens[0]
        while not gen.finished:
            for delta in await gen.next_deltas():
                yield gen, delta
        return
    pending = {asyncio.ensure_future(g.next_deltas()): g for g in gens if not g.finished}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: pending[f].index_base):
                gen = pending.pop(future)
                deltas = future.result()
                if not gen.finished:
                    pending[asyncio.ensure_future(gen.next_deltas())] = gen
                for delta in deltas:
                    yield gen, delta
    finally:
        for future in pending:
            future.cancel()
