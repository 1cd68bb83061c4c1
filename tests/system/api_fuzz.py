"""Hypothesis strategies for the API fuzz (tests/system/test_server_api.py): bodies drawn from
/openapi.json's schemas (valid, with a field broken, or garbage bytes), and hand-written strategies
for the routes /openapi.json does not describe field by field (Responses, Anthropic Messages)."""

from __future__ import annotations

import json

from hypothesis import strategies as st


def from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values valid for a JSON schema (the subset /openapi.json uses), small ones preferred."""
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components, depth)
    if "oneOf" in schema:
        return st.one_of([from_schema(s, components, depth) for s in schema["oneOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    types = schema.get("type", "object")
    if isinstance(types, list):
        return st.one_of([from_schema(schema | {"type": t}, components, depth) for t in types])
    if types == "null":
        return st.none()
    if types == "boolean":
        return st.booleans()
    if types == "integer":
        low = schema.get("minimum", -3)
        return st.integers(low, schema.get("maximum", max(low, 0) + 40))
    if types == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum", -3.0))
        high = schema.get("maximum", low + 5.0)
        return st.floats(low, high, exclude_min="exclusiveMinimum" in schema, allow_nan=False)
    if types == "string":
        if schema.get("propertyNames"):
            return st.integers(0, 50000).map(str)
        return st.text(min_size=schema.get("minLength", 0), max_size=12)
    if types == "array":
        return st.lists(from_schema(schema.get("items", {"type": "integer", "minimum": 0}), components, depth + 1),
                        min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 4), 4))
    properties = schema.get("properties", {})
    if not properties and "additionalProperties" in schema:
        return st.dictionaries(st.integers(0, 50000).map(str), from_schema(schema["additionalProperties"], components),
                               max_size=3)
    required = set(schema.get("required", ()))
    return st.fixed_dictionaries(
        {k: from_schema(v, components, depth + 1) for k, v in properties.items() if k in required},
        optional={k: from_schema(v, components, depth + 1) for k, v in properties.items() if k not in required},
    )


JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**20), 10**20), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8), st.lists(st.integers(-3, 60000), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
)


WORDS = st.text(max_size=12) | st.sampled_from(["Hi", "<tool_call>", "\ud7ff", "", "a" * 40])
TOOL = st.fixed_dictionaries({"name": st.sampled_from(["f", "get_time", ""]) | st.text(max_size=4)},
                             optional={"description": WORDS, "parameters": st.sampled_from(
                                 [{"type": "object"}, {"type": "object", "properties": {"x": {"type": "integer"}}},
                                  {"type": "nope"}, {}])})


def _maybe_junk(draw, value):
    return draw(JUNK) if draw(st.integers(0, 9)) == 0 else value


@st.composite
def responses_body(draw) -> dict:
    """A Responses API body (not described field by field in /openapi.json): text or item input,
    instructions, tools, tool outputs, an unknown previous_response_id, now and then a junk field."""
    item = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "x"]),
                               "content": WORDS | st.lists(st.fixed_dictionaries(
                                   {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                    "text": WORDS}), max_size=2)}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": WORDS, "output": WORDS}))
    body = draw(st.fixed_dictionaries({"input": WORDS | st.lists(item, max_size=3)}, optional={
        "instructions": WORDS, "max_output_tokens": st.integers(-1, 12), "stream": st.booleans(),
        "temperature": st.floats(0, 2), "store": st.booleans(),
        "tools": st.lists(TOOL.map(lambda t: {"type": "function", **t}), max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required"])}))
    if draw(st.integers(0, 9)) == 0:  # rare: an unknown id is a 404 whatever else the body holds
        body["previous_response_id"] = draw(WORDS)
    return {k: _maybe_junk(draw, v) for k, v in body.items()}


@st.composite
def messages_body(draw) -> dict:
    """An Anthropic Messages body: system, text / tool_use / tool_result blocks, stop_sequences, tools."""
    block = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": WORDS}),
                      st.fixed_dictionaries({"type": st.just("tool_use"), "id": WORDS, "name": WORDS,
                                             "input": st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)}),
                      st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": WORDS,
                                             "content": WORDS}),
                      st.fixed_dictionaries({"type": st.sampled_from(["image", "thinking", "?"])}))
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                     "content": WORDS | st.lists(block, max_size=3)})
    body = draw(st.fixed_dictionaries({"messages": st.lists(message, max_size=3), "max_tokens": st.integers(-1, 12)},
                                      optional={"system": WORDS, "stream": st.booleans(), "top_k": st.integers(-1, 5),
                                                "stop_sequences": st.lists(WORDS, max_size=2),
                                                "tools": st.lists(TOOL.map(lambda t: {
                                                    "input_schema": t.pop("parameters", {"type": "object"}), **t}),
                                                    max_size=2),
                                                "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"},
                                                                                {"type": "tool", "name": "f"}])}))
    return {k: _maybe_junk(draw, v) for k, v in body.items()}


HAND_WRITTEN = {"/v1/responses": responses_body, "/v1/messages": messages_body,
                "/v1/messages/count_tokens": messages_body}


@st.composite
def fuzz_request(draw, spec: dict, model: str) -> tuple[str, bytes | dict, bool]:
    """(path, body, cut): a body valid for the spec (or, for the routes in ``HAND_WRITTEN``, drawn by
    their strategy), one with a field broken, or garbage bytes; ``cut``: a streamed answer is
    abandoned after its first event; ``model`` is the served model's name, set on half the bodies."""
    path, schema = draw(st.sampled_from([("/v1/completions", "CompletionRequest"),
                                         ("/v1/chat/completions", "ChatCompletionRequest"),
                                         ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest"),
                                         ("/v1/embeddings", "EmbeddingsRequest"), ("/v1/rerank", "RerankRequest"),
                                         ("/v1/score", "ScoreRequest"), *((route, None) for route in HAND_WRITTEN)]))
    components = spec["components"]["schemas"]
    if schema is None and draw(st.integers(0, 4)) > 0:
        body = draw(HAND_WRITTEN[path]())
        if draw(st.booleans()):
            body["model"] = model
        return path, body, bool(body.get("stream") is True and draw(st.integers(0, 4)) == 0)
    if schema is None:
        return path, draw(st.binary(max_size=40) | JUNK.map(lambda j: json.dumps(j).encode())), False
    kind = draw(st.sampled_from(["valid", "valid", "valid", "broken", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=40) | st.sampled_from([b"{", b"[]", b'{"prompt": "\\ud800"}'])), False
    body = draw(from_schema(components[schema], components))
    if not isinstance(body, dict):
        body = {}
    body.pop("model", None)  # a random name is a 400 at once: name the served model or none
    if draw(st.booleans()):
        body["model"] = model
    if kind == "broken":
        fields = sorted(components[schema].get("properties", {})) or ["prompt"]
        body[draw(st.sampled_from(fields))] = draw(JUNK)
    return path, body, bool(body.get("stream") is True and draw(st.integers(0, 4)) == 0)
