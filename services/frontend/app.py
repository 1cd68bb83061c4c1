"""The aiohttp application: its routes, its start and stop, and the middlewares for errors and
API keys.

Routes live in ``serving`` (completions and chat), ``responses_api`` (the Responses API, on chat's path), ``routes_info`` (models, health, metrics,
tokenize, detokenize, version, openapi.json) and ``playground`` (the page at /, its block-pool
events); what they share is in ``state``.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Callable

import structlog
from aiohttp import web

from services.frontend import anthropic_routes, embeddings_api, responses_api, routes_info, serving
from services.frontend.anthropic_shapes import error_body
from services.frontend.engine_client import EngineClient
from services.frontend.replicas import Replicas
from services.frontend.errors import APIError
from services.frontend.flags import HttpLimits
from services.frontend.http_limits import HTTP_LIMITS, connection_middleware
from services.frontend.logprobs import TokenFormatter
from services.frontend.metrics import FrontendMetrics
from services.frontend.playground import add_playground, is_page_path
from services.frontend.served_model import ServedModel
from services.frontend.state import REQUEST_ID, STATE, FrontendState
from services.frontend.tokenizer_pools import TokenizerPools
from shared.restart_counts import supervised_or_observed

log = structlog.get_logger()

OPEN_PATHS = frozenset({"/health"})  # answered without an API key (load balancers, the launcher)


def create_app(
    model: ServedModel,
    client: EngineClient | Replicas,
    *,
    max_body_bytes: int | None = None,
    shutdown_grace_s: float = 5.0,
    max_queue_len: int | None = None,
    api_key: str | None = None,
    http_limits: HttpLimits | None = None,
    playground: bool = True,
    restarts_file: str | None = None,
) -> web.Application:
    """The frontend's application. Starting it starts ``client`` (ZMQ reader); shutting it down
    gives running requests ``shutdown_grace_s`` to finish, then cancels (and so aborts) them;
    cleaning it up closes the client. Run it with ``handler_cancellation=True`` so that a client
    that goes away cancels its handler, which aborts its request.

    ``max_queue_len``: at most this many engine requests may wait for their first output; more
    get a 503 with ``Retry-After``. ``api_key``: every route but /health needs
    ``Authorization: Bearer <api_key>``. ``max_body_bytes``: ``None`` sizes the body limit from
    the model (``ServedModel.body_limit_bytes``). ``http_limits``: the body-read deadline is read
    from it here; the connection deadlines are the server's (``connection_guard``). ``playground``:
    serve the chat page and /v1/kv/events (``playground``). ``restarts_file``: the launcher's
    restart counts, which /metrics and /health prefer to those the processes saw
    (``shared.restart_counts``)."""
    app = web.Application(client_max_size=max_body_bytes or model.body_limit_bytes,
                          middlewares=[connection_middleware, error_middleware, auth_middleware])
    app[HTTP_LIMITS] = http_limits or HttpLimits()

    def process_restarts() -> dict[str, int]:  # the one source of /metrics' and /health's restart counts
        return supervised_or_observed(client.process_restarts(), restarts_file)

    metrics = FrontendMetrics(lambda: client.latest_stats, process_restarts)
    if isinstance(client, Replicas):
        client.register_metrics(metrics.registry)
    app[STATE] = FrontendState(
        model, client, TokenizerPools(), metrics, TokenFormatter(model.tokenizer), process_restarts,
        max_queue_len=max_queue_len, api_key=api_key or None, shutdown_grace_s=shutdown_grace_s,
    )
    app.router.add_post("/v1/completions", serving.create_completion)
    app.router.add_post("/v1/chat/completions", serving.create_chat_completion)
    responses_api.add_routes(app)
    anthropic_routes.add_routes(app.router)
    embeddings_api.add_routes(app.router)
    routes_info.add_routes(app.router)
    if playground:
        add_playground(app, client)
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
    state.tokenizer_pools.shutdown()


# ---------------------------------------------------------------- middlewares


def error_response(exc: APIError, headers: dict[str, str] | None = None, anthropic: bool = False) -> web.Response:
    """``anthropic``: in Anthropic's shape (its Messages routes), else OpenAI's."""
    body = error_body(exc) if anthropic else exc.to_dict()
    return web.json_response(body, status=exc.status, headers={**(exc.headers or {}), **(headers or {})})


@web.middleware
async def error_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Every error leaves in OpenAI's shape (Anthropic's on its routes); an unexpected one is logged
    and becomes a 500."""
    started = time.monotonic()
    anthropic = anthropic_routes.is_anthropic_path(request.path)
    try:
        response = await handler(request)
    except APIError as exc:
        log.info("request rejected", path=request.path, status=exc.status, param=exc.param, error=exc.message,
                 request_id=request.get(REQUEST_ID))
        response = error_response(exc, anthropic=anthropic)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        response = error_response(_http_error(request, exc), allow, anthropic)
    except asyncio.CancelledError:
        log.info("client went away", path=request.path)
        raise
    except Exception:
        log.exception("unexpected error", method=request.method, path=request.path, request_id=request.get(REQUEST_ID))
        message = "The server had an error while processing the request."
        response = error_response(APIError(500, message, "server_error"), anthropic=anthropic)
    log.debug("http", method=request.method, path=request.path, status=response.status,
              ms=round(1000 * (time.monotonic() - started), 1))
    return response


@web.middleware
async def auth_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    """With an API key set, refuse (401) any request but /health and the playground's page without
    ``Bearer <key>`` (or, on Anthropic's routes, ``x-api-key: <key>``)."""
    state = request.app.get(STATE)
    key = state.api_key if state is not None else None
    if key is None or request.path in OPEN_PATHS or is_page_path(request.path):
        return await handler(request)
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if "x-api-key" in request.headers and anthropic_routes.is_anthropic_path(request.path):
        scheme, token = "bearer", request.headers["x-api-key"]
    given = token.strip().encode("utf-8", "replace")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, key.encode("utf-8", "replace")):
        reason = "no API key was given" if not token else "the API key is not valid"
        raise APIError(
            401, f"Unauthorized: {reason}; send the header 'Authorization: Bearer <key>'.",
            "invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
        )
    return await handler(request)


def _http_error(request: web.Request, exc: web.HTTPException) -> APIError:
    if exc.status == 404:
        return APIError(404, f"Invalid URL ({request.method} {request.path})", code="not_found")
    if exc.status == 405:
        allowed = exc.headers.get("Allow")
        message = f"Method {request.method} is not allowed for {request.path}; allowed: {allowed}"
        return APIError(405, message, code="method_not_allowed")
    if exc.status == 413:
        state = request.app.get(STATE)
        basis = f" (the limit follows max_model_len {state.model.max_model_len})" if state is not None else ""
        return APIError(413, f"The request body is too large: {exc.text}{basis}", code="request_too_large")
    return APIError(exc.status, exc.text or exc.reason)
