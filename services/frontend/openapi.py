"""The OpenAPI 3.1 description served at /openapi.json (written by hand; the tests fuzz from it)."""

from __future__ import annotations

from typing import Any

from services.frontend.options import MAX_LENGTH_PENALTY, MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS
from services.frontend.request_body import MAX_PROMPTS

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_NUMBER = {"type": "number"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _sampling_properties() -> dict[str, Any]:
    """The fields completions and chat share (see ``services/frontend/options.py``)."""
    return {
        "model": {"type": "string", "description": "The served model's name; may be left out."},
        "max_tokens": {"type": ["integer", "null"], "minimum": 1},
        "temperature": _NUMBER | {"minimum": 0, "maximum": 2, "default": 1},
        "top_p": _NUMBER | {"exclusiveMinimum": 0, "maximum": 1, "default": 1},
        "top_k": {"type": "integer", "minimum": -1, "description": "-1 or 0: off."},
        "min_p": _NUMBER | {"minimum": 0, "maximum": 1, "default": 0},
        "presence_penalty": _NUMBER | {"minimum": -2, "maximum": 2, "default": 0},
        "frequency_penalty": _NUMBER | {"minimum": -2, "maximum": 2, "default": 0},
        "repetition_penalty": _NUMBER | {"exclusiveMinimum": 0, "maximum": 2, "default": 1},
        "logit_bias": {
            "type": "object", "description": "Token id (as a string) -> bias added to its logit.",
            "additionalProperties": _NUMBER | {"minimum": -100, "maximum": 100},
            "propertyNames": {"pattern": "^[0-9]+$"},
        },
        "seed": {"type": "integer"},
        "stop": {"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
        ]},
        "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "ignore_eos": {"type": "boolean"},
        "min_tokens": {"type": "integer", "minimum": 0},
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_N, "description": "Choices per prompt (beam width "
              "with use_beam_search)."},
        "best_of": {"type": "integer", "minimum": 1, "maximum": MAX_N, "description": (
            "Sample this many (at least n) and return the n most likely; not with stream unless equal to n.")},
        "use_beam_search": {"type": "boolean", "description": (
            "vLLM's beam search of width n: temperature must be 0 or left out; sampling and penalty fields, "
            "logit_bias, min_tokens, stop_token_ids and logprobs are refused with it. Streamed, each hypothesis "
            "comes as one chunk when the search ends.")},
        "length_penalty": _NUMBER | {"minimum": -MAX_LENGTH_PENALTY, "maximum": MAX_LENGTH_PENALTY, "default": 1,
                                     "description": "Beam search only: scores are divided by length ** this."},
        "early_stopping": {"oneOf": [{"type": "boolean"}, {"const": "never"}], "default": False,
                           "description": "Beam search only, as in transformers."},
        "stream": {"type": "boolean"},
        "stream_options": _ref("StreamOptions"),
        "user": {"type": "string"},
    }


def _schemas() -> dict[str, Any]:
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }}}
    completion = {
        "type": "object", "required": ["prompt"],
        "properties": _sampling_properties() | {
            "prompt": {"oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                 "maxItems": MAX_PROMPTS},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_PROMPTS},
            ]},
            "echo": {"type": "boolean"},
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS},
        },
    }
    message = {
        "type": "object", "required": ["role", "content"],
        "properties": {
            "role": {"enum": ["system", "user", "assistant"]},
            "content": {"oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
                    "type": {"const": "text"}, "text": {"type": "string"}}}},
            ], "description": "May be null for an assistant message."},
        },
    }
    chat = {
        "type": "object", "required": ["messages"],
        "properties": _sampling_properties() | {
            "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
            "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1},
            "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
        },
    }
    usage = {"type": "object", "properties": {
        k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    return {
        "CompletionRequest": completion,
        "ChatCompletionRequest": chat,
        "ChatMessage": message,
        "StreamOptions": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
        "TokenizeRequest": {"oneOf": [
            {"type": "object", "required": ["prompt"], "properties": {
                "model": {"type": "string"}, "prompt": {"type": "string"},
                "add_special_tokens": {"type": "boolean"}}},
            {"type": "object", "required": ["messages"], "properties": {
                "model": {"type": "string"}, "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
                "add_generation_prompt": {"type": "boolean"}}},
        ]},
        "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
            "model": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
        "Usage": usage,
        "Error": error,
        "Completion": {"type": "object", "properties": {
            "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "choices": {"type": "array"}, "usage": _ref("Usage")}},
        "ChatCompletion": {"type": "object", "properties": {
            "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "choices": {"type": "array"}, "usage": _ref("Usage")}},
    }


def _json(schema: str) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(schema)}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": "An error in OpenAI's shape.", "content": _json("Error")} for s in statuses}


def _generate_op(summary: str, request: str, response: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {"description": "The whole answer, or server-sent events when stream is true.",
                    "content": _json(response) | {"text/event-stream": {"schema": {"type": "string"}}}},
        } | _errors(400, 401, 413, 503),
    }}


def _get(summary: str, content_type: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK", "content": {
        content_type: {"schema": {"type": "object"} if content_type == "application/json" else {"type": "string"}}}}}}}


def openapi_spec(version: str, model_name: str, api_key_required: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "pagedserve", "version": version,
                 "description": f"OpenAI-compatible API serving `{model_name}`."},
        "paths": {
            "/v1/completions": _generate_op("Complete prompts.", "CompletionRequest", "Completion"),
            "/v1/chat/completions": _generate_op("Answer a conversation.", "ChatCompletionRequest", "ChatCompletion"),
            "/v1/models": _get("The served model."),
            "/v1/models/{model_id}": {"get": {
                "summary": "One model.",
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "OK", "content": {"application/json": {
                    "schema": {"type": "object"}}}}} | _errors(404),
            }},
            "/tokenize": {"post": {"summary": "Text or messages to token ids.",
                                   "requestBody": {"required": True, "content": _json("TokenizeRequest")},
                                   "responses": {"200": {"description": "OK"}} | _errors(400)}},
            "/detokenize": {"post": {"summary": "Token ids to text.",
                                     "requestBody": {"required": True, "content": _json("DetokenizeRequest")},
                                     "responses": {"200": {"description": "OK"}} | _errors(400)}},
            "/health": _get("200 when the engine is ready, else 503 (never needs the API key)."),
            "/metrics": _get("Prometheus metrics.", "text/plain"),
            "/version": _get("The server's version."),
            "/openapi.json": _get("This document."),
        },
        "components": {"schemas": _schemas()},
    }
    if api_key_required:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        spec["security"] = [{"bearer": []}]
        spec["paths"]["/health"]["get"]["security"] = []
    return spec
