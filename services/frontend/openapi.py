"""The OpenAPI 3.1 description served at /openapi.json; the tests fuzz from it.

The generation requests' schemas are derived from their field declarations (``fields``); the
rest (routes, responses, tokenize) is written here.
"""

from __future__ import annotations

from typing import Any

from services.frontend.embeddings_request import SCHEMAS as EMBEDDING_SCHEMAS
from services.frontend.fields import Route, schema_properties
from services.frontend.request_body import CHAT_MESSAGE_SCHEMA, ChatBody, CompletionBody
from services.frontend.template_kwargs import TEMPLATE_KWARGS
from shared.kv_json import kv_snapshot_schema


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _request_schema(body_cls: type, route: Route) -> dict[str, Any]:
    """A generation route's body, derived from its declared fields (``request_body``, ``options``)."""
    properties, required = schema_properties(body_cls, route)
    return {"type": "object", "required": required, "properties": properties}


def _schemas() -> dict[str, Any]:
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }}}
    usage = {"type": "object", "properties": {
        k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    return {
        "CompletionRequest": _request_schema(CompletionBody, Route.COMPLETIONS),
        "ChatCompletionRequest": _request_schema(ChatBody, Route.CHAT),
        "ChatMessage": CHAT_MESSAGE_SCHEMA,
        **EMBEDDING_SCHEMAS,
        "TokenizeRequest": {"oneOf": [
            {"type": "object", "required": ["prompt"], "properties": {
                "model": {"type": "string"}, "prompt": {"type": "string"},
                "add_special_tokens": {"type": "boolean"}}},
            {"type": "object", "required": ["messages"], "properties": {
                "model": {"type": "string"}, "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
                "add_generation_prompt": {"type": "boolean"}, "chat_template_kwargs": TEMPLATE_KWARGS.schema()}},
        ]},
        "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {
            "model": {"type": "string"}, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
        "MessagesRequest": {"type": "object", "required": ["messages", "max_tokens"], "description": (
            "Anthropic's Messages request (docs/api.md): system, messages (text, tool_use and tool_result "
            "blocks), max_tokens, stop_sequences, temperature, top_p, top_k, tools, tool_choice, metadata, stream."),
            "properties": {"model": {"type": "string"}, "messages": {"type": "array", "minItems": 1},
                           "max_tokens": {"type": "integer", "minimum": 1}}},
        "Message": {"type": "object", "properties": {
            "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
            "content": {"type": "array"}, "stop_reason": {"type": "string"}, "usage": {"type": "object"}}},
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


def _pooling_op(summary: str, request: str) -> dict[str, Any]:
    """/v1/embeddings, /v1/rerank, /v1/score (``embeddings_api``): not streamed."""
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": _json(request)},
                     "responses": {"200": {"description": "OK", "content": {"application/json": {
                         "schema": {"type": "object"}}}}} | _errors(400, 401, 413, 503)}}


def _responses_op() -> dict[str, Any]:
    """The Responses API (``responses_api``): its bodies are OpenAI's, not listed here."""
    body = {"application/json": {"schema": {"type": "object"}}}
    return {"post": {"summary": "Create a response (OpenAI's Responses API).",
                     "requestBody": {"required": True, "content": body},
                     "responses": {"200": {"description": "The response, or its events when stream is true.",
                                           "content": body | {"text/event-stream": {"schema": {"type": "string"}}}},
                                   } | _errors(400, 401, 404, 413, 503)}}


def _by_id(summary: str) -> dict[str, Any]:
    return {"summary": summary,
            "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "OK", "content": {"application/json": {
                "schema": {"type": "object"}}}}} | _errors(400, 404)}


def _get(summary: str, content_type: str = "application/json") -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": {"description": "OK", "content": {
        content_type: {"schema": {"type": "object"} if content_type == "application/json" else {"type": "string"}}}}}}}


def _playground_paths() -> dict[str, Any]:
    """The page (open) and its block-pool events: one ``KvSnapshot`` as JSON in each event's data."""
    event = {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "contentMediaType": "application/json", "contentSchema": _ref("KvSnapshot")}}}
    return {
        "/": {"get": {"summary": "The playground: chat with a live map of the KV block pool.", "security": [],
                      "responses": {"200": {"description": "OK", "content": {"text/html": {"schema": {
                          "type": "string"}}}}}}},
        "/v1/kv/events": {"get": {
            "summary": "The KV block pool, a few snapshots a second at most while the pool changes "
                       "(newest only for a client that reads slowly), as server-sent events.",
            "responses": {"200": {"description": "Server-sent events; each data is a KvSnapshot.", "content": {
                "text/event-stream": {"schema": {"type": "string"}, "itemSchema": event}}}} | _errors(401),
        }},
    }


def openapi_spec(version: str, model_name: str, api_key_required: bool, playground: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "pagedserve", "version": version,
                 "description": f"OpenAI-compatible API serving `{model_name}`."},
        "paths": {
            "/v1/completions": _generate_op("Complete prompts.", "CompletionRequest", "Completion"),
            "/v1/chat/completions": _generate_op("Answer a conversation.", "ChatCompletionRequest", "ChatCompletion"),
            "/v1/responses": _responses_op(),
            "/v1/responses/{response_id}": {
                "get": _by_id("A stored response."), "delete": _by_id("Forget a stored response.")},
            "/v1/responses/{response_id}/cancel": {"post": _by_id("Cancel (only background ones; none here).")},
            "/v1/messages": _generate_op("Anthropic's Messages API (errors in Anthropic's shape).", "MessagesRequest",
                                         "Message"),
            "/v1/messages/count_tokens": {"post": {
                "summary": "The prompt's tokens after the chat template: {input_tokens}.",
                "requestBody": {"required": True, "content": _json("MessagesRequest")},
                "responses": {"200": {"description": "OK"}} | _errors(400, 401)}},
            "/v1/embeddings": _pooling_op("Embed texts or token ids (pooled final hidden states, normalized).",
                                          "EmbeddingsRequest"),
            "/v1/rerank": _pooling_op("Rank documents by the cosine similarity of their embeddings to the query's.",
                                      "RerankRequest"),
            "/v1/score": _pooling_op("Score text pairs: the cosine similarity of their embeddings.", "ScoreRequest"),
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
    if playground:
        spec["paths"].update(_playground_paths())
        spec["components"]["schemas"]["KvSnapshot"] = kv_snapshot_schema()
    if api_key_required:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        spec["security"] = [{"bearer": []}]
        spec["paths"]["/health"]["get"]["security"] = []
    return spec
