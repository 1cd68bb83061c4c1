"""Anthropic's Messages API, as vLLM and llama-server serve it: POST /v1/messages (generation, on
chat's path: ``serving.serve`` with the ``MESSAGES`` endpoint) and POST /v1/messages/count_tokens
(the prompt's tokens after the chat template, nothing generated). The request is rewritten into
chat's (``anthropic_request``), the response translated from chat's (``anthropic_shapes``).

On these paths errors leave in Anthropic's shape (``error_body``, from ``app``'s middleware) and
the API key may come as ``x-api-key`` (what Anthropic's clients send) as well as ``Authorization:
Bearer``; ``anthropic-version`` and ``anthropic-beta`` are accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.frontend.anthropic_request import parse_messages_body
from services.frontend.anthropic_shapes import AnthropicShapes
from services.frontend.http_limits import read_body
from services.frontend.input_limits import check_prompt_chars
from services.frontend.preprocess import PromptInput, chat_inputs, chat_prompt_ids, chat_text_chars
from services.frontend.request_body import parse_json_body
from services.frontend.served_model import ServedModel
from services.frontend.serving import CHAT, Endpoint, serve
from services.frontend.state import STATE

PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def _shape_options(body: Any, model: ServedModel, inputs: list[PromptInput]) -> dict[str, Any]:
    return CHAT.shape_options(body, model, inputs) | {"num_prompt_tokens": len(inputs[0].token_ids)}


MESSAGES = Endpoint("msg", lambda raw, model: parse_messages_body(raw, model.name, model.tool_parser), chat_inputs,
                    chat_text_chars, AnthropicShapes, None, "messages", _shape_options)


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post(PREFIX, create_message)
    router.add_post(PREFIX + "/count_tokens", count_tokens)


async def create_message(request: web.Request) -> web.StreamResponse:
    return await serve(request, MESSAGES)


async def count_tokens(request: web.Request) -> web.Response:
    """``{"input_tokens": n}``: the messages (with the system prompt and tools) through the chat template."""
    state = request.app[STATE]
    model = state.model
    raw = await read_body(request)
    body = parse_messages_body(parse_json_body(raw), model.name, model.tool_parser, count_only=True)
    for num_chars in chat_text_chars(body):
        check_prompt_chars(num_chars, model.max_model_len, model.max_token_chars, "messages")
    ids = await state.tokenize(len(raw), chat_prompt_ids, body, model)
    return web.json_response({"input_tokens": len(ids)})
