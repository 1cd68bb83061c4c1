"""The aiohttp application: OpenAI routes, /health, and errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import structlog
from aiohttp import web

from services.frontend.config import DEFAULT_MAX_BODY_BYTES
from services.frontend.engine_client import EngineClient
from services.frontend.generation import EngineRequestError, Generation
from services.frontend.model import ServedModel
from services.frontend.preprocess import (
    DEFAULT_COMPLETION_MAX_TOKENS, chat_prompt_ids, completion_prompt_ids, sampling_params,
)
from services.frontend.errors import APIError
from services.frontend.protocol import GenerationOptions, parse_chat_body, parse_completion_body, parse_json_body
from services.frontend.responses import (
    SSE_DONE, ChatShapes, CompletionShapes, ResponseShapes, sse_event, usage,
)
from shared.messages import SamplingParams

log = structlog.get_logger()


@dataclass
class FrontendState:
    model: ServedModel
    client: EngineClient
    # Tokenization runs off the event loop, on one thread (HF tokenizers are not thread-safe).
    tokenizer_pool: ThreadPoolExecutor
    # Handler tasks with a request at the scheduler, so that shutdown can end them (and abort).
    generating: set[asyncio.Task] = field(default_factory=set)
    shutdown_grace_s: float = 5.0

    async def tokenize(self, fn: Callable[..., list[int]], *args: Any) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)


STATE = web.AppKey("state", FrontendState)
REQUEST_ID = web.RequestKey("request_id", str)


def create_app(
    model: ServedModel,
    client: EngineClient,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    shutdown_grace_s: float = 5.0,
) -> web.Application:
    """The frontend's application. Starting it starts ``client`` (ZMQ reader); shutting it down
    gives running requests ``shutdown_grace_s`` to finish, then cancels (and so aborts) them;
    cleaning it up closes the client. Run it with ``handler_cancellation=True`` so that a client
    that goes away cancels its handler, which aborts its request."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[error_middleware])
    pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    app[STATE] = FrontendState(model, client, pool, shutdown_grace_s=shutdown_grace_s)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id}", retrieve_model)
    app.router.add_get("/health", health)
    app.on_startup.append(_start_client)
    app.on_shutdown.append(_end_generations)
    app.on_cleanup.append(_stop_client)
    return app


async def _start_client(app: web.Application) -> None:
    await app[STATE].client.start()


async def _end_generations(app: web.Application) -> None:
    state = app[STATE]
    if not state.generating:
        return
    log.info("waiting for running requests", num_requests=len(state.generating), grace_s=state.shutdown_grace_s)
    _, pending = await asyncio.wait(set(state.generating), timeout=state.shutdown_grace_s)
    if not pending:
        return
    # Each handler answers its client (a 503, or an error event then [DONE]) and returns.
    num_aborted = state.client.abort_all("the server is shutting down")
    log.info("aborted running requests", num_requests=num_aborted)
    _, pending = await asyncio.wait(pending, timeout=1.0)
    for task in pending:
        task.cancel()


async def _stop_client(app: web.Application) -> None:
    state = app[STATE]
    await state.client.close()
    state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------- errors


def error_response(exc: APIError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(exc.to_dict(), status=exc.status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Every error leaves in OpenAI's shape; an unexpected one is logged and becomes a 500."""
    started = time.monotonic()
    try:
        response = await handler(request)
    except APIError as exc:
        log.info("request rejected", path=request.path, status=exc.status, param=exc.param, error=exc.message,
                 request_id=request.get(REQUEST_ID))
        response = error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        response = error_response(_http_error(request, exc), allow)
    except asyncio.CancelledError:
        log.info("client went away", path=request.path)
        raise
    except Exception:
        log.exception("unexpected error", method=request.method, path=request.path, request_id=request.get(REQUEST_ID))
        message = "The server had an error while processing the request."
        response = error_response(APIError(500, message, "server_error"))
    log.debug("http", method=request.method, path=request.path, status=response.status,
              ms=round(1000 * (time.monotonic() - started), 1))
    return response


def _http_error(request: web.Request, exc: web.HTTPException) -> APIError:
    if exc.status == 404:
        return APIError(404, f"Invalid URL ({request.method} {request.path})", code="not_found")
    if exc.status == 405:
        allowed = exc.headers.get("Allow")
        message = f"Method {request.method} is not allowed for {request.path}; allowed: {allowed}"
        return APIError(405, message, code="method_not_allowed")
    if exc.status == 413:
        return APIError(413, f"The request body is too large: {exc.text}", code="request_too_large")
    return APIError(exc.status, exc.text or exc.reason)


# ---------------------------------------------------------------- generation routes


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    request_id = request[REQUEST_ID] = f"cmpl-{uuid.uuid4().hex}"
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        body = parse_completion_body(parse_json_body(await request.read()), state.model.name)
        prompt_ids = await state.tokenize(completion_prompt_ids, body, state.model)
        sampling = sampling_params(body.options, len(prompt_ids), state.model, DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
        shapes = CompletionShapes(request_id, int(time.time()), state.model.name, body.options.include_usage)
        return await _generate(request, state, shapes, prompt_ids, sampling, body.options)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    request_id = request[REQUEST_ID] = f"chatcmpl-{uuid.uuid4().hex}"
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        body = parse_chat_body(parse_json_body(await request.read()), state.model.name)
        prompt_ids = await state.tokenize(chat_prompt_ids, body, state.model)
        sampling = sampling_params(body.options, len(prompt_ids), state.model, None, "messages")
        shapes = ChatShapes(request_id, int(time.time()), state.model.name, body.options.include_usage)
        return await _generate(request, state, shapes, prompt_ids, sampling, body.options)


async def _generate(
    request: web.Request,
    state: FrontendState,
    shapes: ResponseShapes,
    prompt_ids: list[int],
    sampling: SamplingParams,
    options: GenerationOptions,
) -> web.StreamResponse:
    gen = Generation(
        state.client, shapes.request_id, prompt_ids, sampling, state.model.eos_token_ids,
        state.model.tokenizer, options.stop,
    )
    gen.start()
    task = asyncio.current_task()
    state.generating.add(task)
    try:
        if options.stream:
            return await _stream(request, gen, shapes)
        while not gen.finished:
            await gen.next_delta()
    except EngineRequestError as exc:
        raise _api_error(exc) from None
    finally:
        state.generating.discard(task)
        gen.close()  # aborts unless finished: client gone, handler cancelled, or a bug
    assert gen.finish_reason is not None
    body = shapes.full(gen.text, gen.finish_reason, usage(gen.num_prompt_tokens, gen.num_completion_tokens))
    return web.json_response(body)


async def _stream(request: web.Request, gen: Generation, shapes: ResponseShapes) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    try:
        for chunk in shapes.opening_chunks():
            await response.write(sse_event(chunk))
        try:
            while not gen.finished:
                delta = await gen.next_delta()
                if delta.text or delta.finish_reason is not None:
                    await response.write(sse_event(shapes.chunk(delta.text, delta.finish_reason)))
            if shapes.include_usage:
                final_usage = usage(gen.num_prompt_tokens, gen.num_completion_tokens)
                await response.write(sse_event(shapes.usage_chunk(final_usage)))
        except EngineRequestError as exc:
            await response.write(sse_event(_api_error(exc).to_dict()))
        await response.write(SSE_DONE)
        await response.write_eof()
    except ConnectionResetError:
        log.info("client disconnected mid-stream", num_completion_tokens=gen.num_completion_tokens)
    return response


def _api_error(exc: EngineRequestError) -> APIError:
    return APIError(exc.status, exc.message, "invalid_request_error" if exc.status < 500 else "server_error")


# ---------------------------------------------------------------- models and health


def _model_card(model: ServedModel) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "pagedserve",
        "root": model.name,
        "parent": None,
        "max_model_len": model.max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[STATE].model)]})


async def retrieve_model(request: web.Request) -> web.Response:
    model = request.app[STATE].model
    model_id = request.match_info["model_id"]
    if model_id != model.name:
        raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
    return web.json_response(_model_card(model))


async def health(request: web.Request) -> web.Response:
    """200 when the scheduler's latest ``EngineStats`` says ready, else 503."""
    client = request.app[STATE].client
    stats = client.latest_stats
    if stats is None:
        return web.json_response({"status": "unavailable", "reason": "no stats from the scheduler yet"}, status=503)
    body = {
        "status": "ok" if stats.ready else "unavailable",
        "seconds_since_stats": round(time.monotonic() - (client.latest_stats_time or 0.0), 3),
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_blocks_total": stats.num_blocks_total,
        "num_blocks_used": stats.num_blocks_used,
        "num_preemptions": stats.num_preemptions,
        # mean over all steps so far of slots holding tokens / slots allocated
        "kv_slot_utilization": (
            stats.sum_slots_used / stats.sum_slots_allocated if stats.sum_slots_allocated else None
        ),
    }
    return web.json_response(body, status=200 if stats.ready else 503)
