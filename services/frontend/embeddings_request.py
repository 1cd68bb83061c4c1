"""The bodies of /v1/embeddings (OpenAI's), /v1/rerank (Cohere's and Jina's) and /v1/score (vLLM's):
parsed and checked into plain values, every mistake a 400 naming its field. No I/O.

Limits: at most ``MAX_EMBEDDING_INPUTS`` texts in one request (OpenAI's own limit for ``input``;
rerank's documents, and score's pairs, count the same way); each input at most the model's
context (``max_model_len`` tokens: checked after tokenizing, ``embeddings_api``). ``dimensions``
is honoured only by a Matryoshka model (its config says ``is_matryoshka`` or lists
``matryoshka_dimensions``, as vLLM reads them); any other model answers 400, since truncating the
vector of a model not trained for it gives a worse embedding, not a shorter one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.frontend.errors import as_bool, bad_request, is_int, json_type
from services.frontend.request_body import check_model

MAX_EMBEDDING_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")

Input = str | list[int]  # a text, or its token ids


@dataclass(frozen=True)
class EmbeddingsBody:
    inputs: list[Input]
    encoding_format: str = "float"
    dimensions: int | None = None


@dataclass(frozen=True)
class RerankBody:
    query: str
    documents: list[str]
    top_n: int
    return_documents: bool


@dataclass(frozen=True)
class ScoreBody:
    pairs: list[tuple[str, str]]  # (text_1, text_2), one per score, in order


def _check_count(n: int, param: str) -> None:
    if n > MAX_EMBEDDING_INPUTS:
        raise bad_request(f"{param} holds {n} inputs; at most {MAX_EMBEDDING_INPUTS} are allowed in one request",
                          param, "too_many_inputs")


def parse_inputs(value: Any, param: str = "input") -> list[Input]:
    """OpenAI's four shapes of ``input``: a string, a list of strings, a list of token ids, a list
    of lists of token ids; none may be empty."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(is_int(t) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad_request(f"{param} must be a non-empty string, list of strings, list of token ids or list of "
                          f"lists of token ids, got {json_type(value) if value != [] else 'an empty list'}", param)
    _check_count(len(value), param)
    for idx, item in enumerate(value):
        where = f"{param}[{idx}]" if len(value) > 1 else param
        if isinstance(item, list) and all(is_int(t) and t >= 0 for t in item) and item:
            continue
        if isinstance(item, str) and item:
            continue
        if item in ("", []):
            raise bad_request(f"{where} must not be empty", param)
        raise bad_request(f"{where} must be a string or a list of non-negative token ids, got {json_type(item)}",
                          param)
    return [item if isinstance(item, str) else list(item) for item in value]


def parse_embeddings_body(body: dict[str, Any], served_model_name: str, matryoshka: tuple[int, ...] | None
                          ) -> EmbeddingsBody:
    """``matryoshka``: the dimensions the model allows (empty: any up to its width; None: the model
    is not a Matryoshka model and ``dimensions`` answers 400)."""
    check_model(body, served_model_name)
    if "input" not in body:
        raise bad_request("input is required", "input")
    inputs = parse_inputs(body["input"])
    fmt = body.get("encoding_format")
    fmt = "float" if fmt is None else fmt
    if fmt not in ENCODING_FORMATS:
        raise bad_request(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, got {fmt!r}"
                          if isinstance(fmt, str) else f"encoding_format must be a string, got {json_type(fmt)}",
                          "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if not is_int(dimensions) or dimensions < 1:
            raise bad_request(f"dimensions must be a positive integer, got {json_type(dimensions)}", "dimensions")
        if matryoshka is None:
            raise bad_request("dimensions is not supported by this model: it is not a Matryoshka embedding model "
                              "(its config says neither is_matryoshka nor matryoshka_dimensions)", "dimensions")
        if matryoshka and dimensions not in matryoshka:
            raise bad_request(f"dimensions must be one of the model's matryoshka_dimensions "
                              f"{list(matryoshka)}, got {dimensions}", "dimensions")
    return EmbeddingsBody(inputs, fmt, dimensions)


def _text(value: Any, param: str) -> str:
    if isinstance(value, dict) and set(value) <= {"text"}:  # Jina's / Cohere's {"text": ...}
        value = value.get("text")
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string" + ("" if isinstance(value, str) else
                          f" (or an object with one), got {json_type(value)}"), param)
    return value


def _texts(value: Any, param: str) -> list[str]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise bad_request(f"{param} must not be empty", param)
    _check_count(len(items), param)
    return [_text(item, f"{param}[{i}]" if isinstance(value, list) else param) for i, item in enumerate(items)]


def parse_rerank_body(body: dict[str, Any], served_model_name: str) -> RerankBody:
    check_model(body, served_model_name)
    query = _text(body.get("query"), "query")
    if not isinstance(body.get("documents"), list):
        raise bad_request(f"documents must be a list of strings or {{text}} objects, got "
                          f"{json_type(body.get('documents'))}", "documents")
    documents = _texts(body["documents"], "documents")
    top_n = body.get("top_n")
    if top_n is not None and (not is_int(top_n) or top_n < 1):
        raise bad_request(f"top_n must be a positive integer, got {json_type(top_n)}", "top_n")
    return_documents = body.get("return_documents")
    return RerankBody(query, documents, len(documents) if top_n is None else min(top_n, len(documents)),
                      True if return_documents is None else as_bool("return_documents", return_documents))


def parse_score_body(body: dict[str, Any], served_model_name: str) -> ScoreBody:
    """vLLM's pairing: one text_1 with every text_2, or the two lists pairwise (equal lengths)."""
    check_model(body, served_model_name)
    for name in ("text_1", "text_2"):
        if name not in body:
            raise bad_request(f"{name} is required", name)
    first, second = _texts(body["text_1"], "text_1"), _texts(body["text_2"], "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise bad_request(f"text_1 and text_2 must have the same length (or text_1 one text), got {len(first)} "
                          f"and {len(second)}", "text_2")
    return ScoreBody(list(zip(first, second)))


_TEXT_OR_TEXTS = {"oneOf": [{"type": "string", "minLength": 1},
                            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}]}
# /openapi.json's request schemas of the three routes (``openapi``)
SCHEMAS: dict[str, Any] = {
    "EmbeddingsRequest": {"type": "object", "required": ["input"], "properties": {
        "model": {"type": "string"},
        "input": {"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
             "maxItems": MAX_EMBEDDING_INPUTS},
            {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
             "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS}]},
        "encoding_format": {"enum": list(ENCODING_FORMATS)},
        "dimensions": {"type": "integer", "minimum": 1, "description": "Matryoshka models only."},
        "user": {"type": "string"}}},
    "RerankRequest": {"type": "object", "required": ["query", "documents"], "properties": {
        "model": {"type": "string"}, "query": {"type": "string", "minLength": 1},
        "documents": {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS, "items": {"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "object", "required": ["text"], "properties": {"text": {"type": "string", "minLength": 1}}}]}},
        "top_n": {"type": "integer", "minimum": 1}, "return_documents": {"type": "boolean"}}},
    "ScoreRequest": {"type": "object", "required": ["text_1", "text_2"], "properties": {
        "model": {"type": "string"}, "text_1": _TEXT_OR_TEXTS, "text_2": _TEXT_OR_TEXTS}},
}
