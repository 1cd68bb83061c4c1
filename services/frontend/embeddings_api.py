"""/v1/embeddings (OpenAI's shape), /v1/rerank (Cohere's and Jina's) and /v1/score (vLLM's).

Every text is embedded by the served decoder model: its final hidden states (after the final norm)
pooled over the prompt (``--pooling``: the last token's, or the mean), L2-normalized, as
Qwen3-Embedding and e5-mistral are used. Rerank and score have no classification head to run, so a
pair's score is the cosine similarity of its two texts' embeddings (what vLLM does for an
embedding model), in [-1, 1]. Each distinct text is embedded once per request.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Callable

import numpy as np
import structlog
from aiohttp import web

from services.frontend.embeddings_engine import embed_token_lists, normalized
from services.frontend.embeddings_request import (
    Input, parse_embeddings_body, parse_rerank_body, parse_score_body,
)
from services.frontend.errors import bad_request
from services.frontend.http_limits import read_body
from services.frontend.input_limits import check_prompt_chars
from services.frontend.request_body import parse_json_body
from services.frontend.served_model import ServedModel
from services.frontend.serving import _admit as admit
from services.frontend.state import REQUEST_ID, STATE, FrontendState

log = structlog.get_logger()


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/v1/embeddings", create_embeddings)
    router.add_post("/v1/rerank", rerank)
    router.add_post("/v1/score", score)


def _tokenize(inputs: list[Input], model: ServedModel, param: str) -> list[list[int]]:
    """Each input's token ids (texts with the tokenizer's special tokens, as vLLM embeds them), each
    checked against the vocabulary and the context."""
    out = []
    for idx, item in enumerate(inputs):
        where = f"{param}[{idx}]" if len(inputs) > 1 else param
        ids = list(model.tokenizer(item)["input_ids"]) if isinstance(item, str) else item
        bad = next((t for t in ids if t >= model.vocab_size), None)
        if bad is not None:
            raise bad_request(f"{where}: token id {bad} is out of range [0, {model.vocab_size})", param)
        if not ids:
            raise bad_request(f"{where} is empty after tokenization", param)
        if len(ids) >= model.max_model_len:
            raise bad_request(f"{where} has {len(ids)} tokens; this model's maximum context length is "
                              f"{model.max_model_len} tokens, so an input may have at most "
                              f"{model.max_model_len - 1}", param, "context_length_exceeded")
        out.append(ids)
    return out


async def _embed(request: web.Request, state: FrontendState, inputs: list[Input], param: str,
                 dimensions: int | None = None) -> tuple[list[np.ndarray], int]:
    """The normalized embedding of each input and the prompt tokens of them all (distinct inputs
    are embedded once)."""
    model = state.model
    distinct = list(dict.fromkeys(tuple(i) if isinstance(i, list) else i for i in inputs))
    chars = [len(t) for t in distinct if isinstance(t, str)]
    for num_chars in chars:
        check_prompt_chars(num_chars, model.max_model_len, model.max_token_chars, param)
    items = [list(t) if isinstance(t, tuple) else t for t in distinct]
    token_lists = await state.tokenize(sum(chars), _tokenize, items, model, param)
    admit(state, len(token_lists))
    vectors = await embed_token_lists(state, request[REQUEST_ID], token_lists)
    if dimensions is not None and dimensions > len(vectors[0]):
        raise bad_request(f"dimensions must be at most the model's embedding size {len(vectors[0])}, got "
                          f"{dimensions}", "dimensions")
    by_input = {key: (normalized(v, dimensions), len(t)) for key, v, t in zip(distinct, vectors, token_lists)}
    found = [by_input[tuple(i) if isinstance(i, list) else i] for i in inputs]
    return [v for v, _ in found], sum(n for _, n in found)  # usage counts every input, as sent


async def _handle(request: web.Request, prefix: str, answer: Callable[[web.Request, dict[str, Any]], Any]):
    request_id = request[REQUEST_ID] = f"{prefix}-{uuid.uuid4().hex}"
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        return web.json_response(await answer(request, parse_json_body(await read_body(request))))


async def create_embeddings(request: web.Request) -> web.Response:
    return await _handle(request, "embd", _embeddings)


async def rerank(request: web.Request) -> web.Response:
    return await _handle(request, "rerank", _rerank)


async def score(request: web.Request) -> web.Response:
    return await _handle(request, "score", _score)


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the little-endian float32 bytes
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def _embeddings(request: web.Request, obj: dict[str, Any]) -> dict[str, Any]:
    state = request.app[STATE]
    body = parse_embeddings_body(obj, state.model.name, state.model.matryoshka_dimensions)
    vectors, num_tokens = await _embed(request, state, body.inputs, "input", body.dimensions)
    return {"object": "list", "model": state.model.name,
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def _rerank(request: web.Request, obj: dict[str, Any]) -> dict[str, Any]:
    state = request.app[STATE]
    body = parse_rerank_body(obj, state.model.name)
    vectors, num_tokens = await _embed(request, state, [body.query, *body.documents], "documents")
    scores = [float(np.dot(vectors[0], v)) for v in vectors[1:]]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    results = [{"index": i, "relevance_score": scores[i]} | ({"document": {"text": body.documents[i]}}
                                                             if body.return_documents else {}) for i in order]
    return {"id": request[REQUEST_ID], "model": state.model.name, "results": results,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


async def _score(request: web.Request, obj: dict[str, Any]) -> dict[str, Any]:
    state = request.app[STATE]
    body = parse_score_body(obj, state.model.name)
    texts = [t for pair in body.pairs for t in pair]
    vectors, num_tokens = await _embed(request, state, texts, "text_2")
    data = [{"index": i, "object": "score", "score": float(np.dot(vectors[2 * i], vectors[2 * i + 1]))}
            for i in range(len(body.pairs))]
    return {"id": request[REQUEST_ID], "object": "list", "created": int(time.time()), "model": state.model.name,
            "data": data, "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
