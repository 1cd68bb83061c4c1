"""The OpenAI Responses API on chat's path (``serving.serve_object``): ``POST /v1/responses``
(whole or streamed), ``GET`` and ``DELETE /v1/responses/{response_id}``, and
``POST /v1/responses/{response_id}/cancel``. A request becomes a chat request
(``responses_request``), chat's result becomes a response (``responses_output``; streamed:
``responses_stream``), and a stored one (``responses_store``) can be fetched or continued with
``previous_response_id``. ``background`` is not served, so no response is ever left to cancel:
cancel answers as OpenAI does for a response that was not created in the background."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import structlog
from aiohttp import web

from services.frontend.chat_stream import SSE_HEADERS
from services.frontend.errors import APIError, bad_request
from services.frontend.http_limits import read_body
from services.frontend.request_body import parse_json_body
from services.frontend.responses_output import envelope, finished, item_id, output_messages, output_of_chat
from services.frontend.responses_request import ResponsesRequest, read_request
from services.frontend.responses_store import ResponseStore, Stored
from services.frontend.responses_stream import ResponseEvents, sse
from services.frontend.serving import CHAT, Sink, serve_object
from services.frontend.state import REQUEST_ID, STATE

log = structlog.get_logger()

STORE = web.AppKey("responses_store", ResponseStore)


def add_routes(app: web.Application) -> None:
    app[STORE] = ResponseStore()
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)


def not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", param,
                    "response_not_found")


async def create_response(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    response_id = request[REQUEST_ID] = item_id("resp")
    with structlog.contextvars.bound_contextvars(request_id=response_id):
        raw = await read_body(request)
        body = parse_json_body(raw)
        parsed = read_request(body, _previous(request.app[STORE], body.get("previous_response_id")))
        base = envelope(response_id, int(time.time()), request.app[STATE].model.name, body, "in_progress")
        store = request.app[STORE] if parsed.store else None

        def whole(chat: dict[str, Any]) -> web.StreamResponse:
            output, finish_reason = output_of_chat(chat)
            response = finished(base, output, finish_reason, chat.get("usage"))
            _keep(store, parsed, response)
            return web.json_response(response)

        async def stream(request: web.Request, chunks: AsyncIterator[dict[str, Any]], shapes=None) -> web.StreamResponse:
            return await _stream(request, chunks, ResponseEvents(base), store, parsed)

        return await serve_object(request, CHAT, parsed.chat, len(raw), arrival, Sink(whole, stream))


def _previous(store: ResponseStore, previous_id: Any) -> list[dict[str, Any]]:
    """The conversation ``previous_response_id`` continues (``[]`` without one)."""
    if previous_id is None:
        return []
    if not isinstance(previous_id, str):
        raise bad_request("previous_response_id must be a string", "previous_response_id")
    stored = store.get(previous_id)
    if stored is None:
        raise not_found(previous_id, "previous_response_id")
    return [dict(message) for message in stored.messages]


def _keep(store: ResponseStore | None, parsed: ResponsesRequest, response: dict[str, Any]) -> None:
    if store is not None and response["status"] in ("completed", "incomplete"):
        store.put(Stored(response, parsed.messages + output_messages(response["output"])))


async def _stream(request: web.Request, chunks: AsyncIterator[dict[str, Any]], events: ResponseEvents,
                  store: ResponseStore | None, parsed: ResponsesRequest) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        async with contextlib.aclosing(chunks):  # a client gone: the generation closes now
            for event in events.start():
                await response.write(sse(event))
            async for chunk in chunks:
                for event in events.feed(chunk):
                    await response.write(sse(event))
            for event in events.end():
                await response.write(sse(event))
        await response.write_eof()
    except ConnectionResetError:
        log.info("client disconnected mid-stream")
        return response
    if events.final is not None:
        _keep(store, parsed, events.final)
    return response


def _stored(request: web.Request) -> Stored:
    response_id = request.match_info["response_id"]
    stored = request.app[STORE].get(response_id)
    if stored is None:
        raise not_found(response_id)
    return stored


async def retrieve_response(request: web.Request) -> web.Response:
    return web.json_response(_stored(request).response)


async def delete_response(request: web.Request) -> web.Response:
    response_id = _stored(request).response["id"]
    request.app[STORE].delete(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    """Only a background response can be cancelled, and none is served: a stored one is a 400."""
    _stored(request)
    raise bad_request("Cannot cancel a synchronous response: only responses created with background=true "
                      "can be cancelled (this server does not serve background responses).", "response_id")
