"""The routes that generate nothing: models, health, metrics, tokenize, detokenize, version, the
OpenAPI description."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from services.frontend.errors import APIError, bad_request, is_int, optional_bool
from services.frontend.health_report import health_report
from services.frontend.http_limits import read_body
from services.frontend.input_limits import chat_chars, check_prompt_chars
from services.frontend.openapi import openapi_spec
from services.frontend.playground import KV_HUB
from services.frontend.preprocess import chat_prompt_ids
from services.frontend.request_body import ChatBody, check_model, parse_json_body, parse_messages
from services.frontend.served_model import ServedModel
from services.frontend.state import STATE
from services.frontend.template_kwargs import read_template_kwargs
from services.frontend.tools import read_tools


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/v1/models", list_models)
    router.add_get("/v1/models/{model_id}", retrieve_model)
    router.add_get("/health", health)
    router.add_get("/metrics", metrics)
    router.add_post("/tokenize", tokenize)
    router.add_post("/detokenize", detokenize)
    router.add_get("/version", version)
    router.add_get("/openapi.json", openapi)


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
    """200 when every process answers and the scheduler is ready, else 503 (see ``health``)."""
    state = request.app[STATE]
    status, body = health_report(state.client, state.process_restarts())
    return web.json_response(body, status=status)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition."""
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def tokenize(request: web.Request) -> web.Response:
    """``{"prompt": str, "add_special_tokens": bool}`` or ``{"messages": [...], "add_generation_prompt":
    bool, "tools": [...], "chat_template_kwargs": {...}}`` -> ``{"tokens": [...], "count": n,
    "max_model_len": m}`` (the tools and the template's variables go to the chat template, as chat's do)."""
    state = request.app[STATE]
    model = state.model
    raw = await read_body(request)
    body = parse_json_body(raw)
    check_model(body, model.name)
    if "messages" in body and body.get("prompt") is None:
        tools = [] if body.get("tools") is None else read_tools("tools", body["tools"])
        template_kwargs = body.get("chat_template_kwargs")
        chat = ChatBody(messages=parse_messages(body.get("messages")), tools=tools, chat_template_kwargs={} if
                        template_kwargs is None else read_template_kwargs("chat_template_kwargs", template_kwargs))
        add_generation_prompt = body.get("add_generation_prompt", True)
        if not isinstance(add_generation_prompt, bool):
            raise bad_request("add_generation_prompt must be a boolean", "add_generation_prompt")
        check_prompt_chars(chat_chars(chat.messages), model.max_model_len, model.max_token_chars, "messages")
        ids = await state.tokenize(len(raw), chat_prompt_ids, chat, model, add_generation_prompt)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("prompt must be a string (or send messages instead)", "prompt")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise bad_request("add_special_tokens must be a boolean", "add_special_tokens")
        check_prompt_chars(len(prompt), model.max_model_len, model.max_token_chars, "prompt")
        ids = await state.tokenize(len(raw), _encode, model, prompt, add_special)
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": state.model.max_model_len})


def _encode(model: ServedModel, text: str, add_special_tokens: bool) -> list[int]:
    return list(model.tokenizer.encode(text, add_special_tokens=add_special_tokens))


async def detokenize(request: web.Request) -> web.Response:
    """``{"tokens": [ids]}`` -> ``{"prompt": text}``."""
    state = request.app[STATE]
    raw = await read_body(request)
    body = parse_json_body(raw)
    check_model(body, state.model.name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise bad_request("tokens must be a list of integer token ids", "tokens")
    vocab = state.model.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens: token id {bad} is out of range [0, {vocab})", "tokens")
    skip = optional_bool(body, "skip_special_tokens") if "skip_special_tokens" in body else True
    text = await state.tokenize(len(raw), _decode, state.model, tokens, skip)
    return web.json_response({"prompt": text})


def _decode(model: ServedModel, tokens: list[int], skip_special_tokens: bool) -> str:
    return model.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)


def package_version() -> str:
    try:
        return metadata.version("pagedserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": package_version()})


async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(openapi_spec(package_version(), state.model.name, state.api_key is not None,
                                          playground=KV_HUB in request.app))
