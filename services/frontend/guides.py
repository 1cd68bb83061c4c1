"""Structured outputs: the request fields that guide decoding, each read into a guide spec.

- OpenAI's ``response_format``: ``{"type": "text"}`` (free text, as when left out), ``{"type":
  "json_object"}`` (any JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}`` (a value valid against ``schema``). ``name`` is required, as OpenAI
  and vLLM require it; ``schema`` left out is ``{}`` (any JSON value, as JSON Schema reads it);
  ``strict`` and ``description`` are accepted and unused (decoding is always constrained).
- vLLM's ``guided_json`` (a schema, as an object or as JSON text), ``guided_choice`` (a
  non-empty list of non-empty strings: the output is exactly one of them), ``guided_regex`` (the
  output matches the regex whole; Rust ``regex`` syntax, as llguidance reads it) and
  ``guided_grammar`` (a context-free grammar: GBNF as llama.cpp and vLLM write it, or Lark), and
  ``structured_outputs`` holding any one of these.

Each reads into a spec ``shared.structured.compile_guide`` takes (``{"json_object": true}``,
``{"json_schema": schema}``, ``{"choice": [...]}``, ``{"regex": r}``, ``{"grammar": g}``; ``None``:
free text), compiled here by llguidance so that a schema, regex or grammar it cannot follow is a 400
naming the field and saying where (llguidance's message) rather than a failure in the executor; a
spec over ``MAX_GUIDE_BYTES`` is a 400 naming the limit. The spec reaches ``SamplingParams.guided``
as JSON text; ``request_rules`` allows one guide per request, and the rulebook
(``shared.messages.sampling_rules``) none with beam search. vLLM's ``guided_whitespace_pattern``
is refused (``request_body``), not ignored.
"""

from __future__ import annotations

import json
from typing import Any

from services.frontend.errors import APIError, bad_request, describe, json_type, reject_constant
from services.frontend.field_kinds import Custom
from shared.messages.sampling_rules import guide_error
from shared.structured import MAX_GUIDE_BYTES

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
# ``GenerationOptions``' guides
GUIDE_FIELDS = ("response_format", "guided_json", "guided_choice", "guided_regex", "guided_grammar",
                "structured_outputs")
# vLLM's structured_outputs: what each key becomes; the keys refused (a kind of guide we cannot
# follow) and the ones read past (a backend's tuning, no change to what is valid)
_STRUCTURED_KINDS = ("json", "choice", "json_object", "regex", "grammar")
_STRUCTURED_REFUSED = ("structural_tag", "whitespace_pattern")
_STRUCTURED_PASSED = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")


def checked(spec: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """``spec`` once ``compile_guide`` takes it; else a 400 naming ``name`` (``where``: the part of
    the field that holds the spec, for the message). Runs on the event loop: the rulebook keeps
    the verdicts of the last ``sampling_rules.GUIDES_KEPT`` specs (``guide_error``), as clients send
    the same schema again and again (a large one takes tens of milliseconds to compile)."""
    try:
        text = json.dumps(spec)
    except (ValueError, RecursionError):
        raise bad_request(f"{where}: the schema is nested too deeply", name) from None
    error = guide_error(text)
    if error is not None:
        raise bad_request(f"{where}: {error}", name)
    return spec


def _read_response_format(name: str, value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object, got {json_type(value)}", name)
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        got = "nothing" if kind is None else describe(kind)
        raise bad_request(f"{name}.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {got}", name)
    if kind == "text":
        return None
    if kind == "json_object":
        return checked({"json_object": True}, name, name)
    where = f"{name}.json_schema"
    json_schema = value.get("json_schema")
    if not isinstance(json_schema, dict):
        got = "nothing" if json_schema is None else json_type(json_schema)
        raise bad_request(f'{where} must be an object with type "json_schema", got {got}', name)
    if not isinstance(json_schema.get("name"), str):
        got = "nothing" if json_schema.get("name") is None else json_type(json_schema["name"])
        raise bad_request(f"{where}.name must be a string (the schema's name), got {got}", name)
    schema = json_schema.get("schema")
    if schema is None:
        schema = {}  # JSON Schema's "anything"
    elif not isinstance(schema, dict):
        raise bad_request(f"{where}.schema must be a JSON schema (an object), got {json_type(schema)}", name)
    return checked({"json_schema": schema}, name, where)


def _read_guided_json(name: str, value: Any) -> dict[str, Any]:
    schema = value
    if isinstance(value, str):
        try:
            schema = json.loads(value, parse_constant=reject_constant)
        except ValueError as exc:
            raise bad_request(f"{name} is a string but not valid JSON: {exc}", name) from None
        except RecursionError:
            raise bad_request(f"{name} is nested too deeply", name) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{name} must be a JSON schema (an object, or its JSON text), got {json_type(schema)}",
                          name)
    return checked({"json_schema": schema}, name, name)


def _read_guided_choice(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, list) or not value:
        raise bad_request(f"{name} must be a non-empty list of strings, got {describe(value)}", name)
    for idx, choice in enumerate(value):
        if not isinstance(choice, str) or not choice:
            raise bad_request(f"{name}[{idx}] must be a non-empty string, got {describe(choice)}", name)
    return checked({"choice": list(value)}, name, name)


def _read_text_guide(kind: str, name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a non-empty string ({'a regex' if kind == 'regex' else 'a grammar'}), "
                          f"got {describe(value)}", name)
    if len(value.encode()) > MAX_GUIDE_BYTES:
        raise bad_request(f"{name} is {len(value.encode())} bytes, over the limit of {MAX_GUIDE_BYTES} bytes", name)
    return checked({kind: value}, name, name)


def _read_guided_regex(name: str, value: Any) -> dict[str, Any]:
    return _read_text_guide("regex", name, value)


def _read_guided_grammar(name: str, value: Any) -> dict[str, Any]:
    return _read_text_guide("grammar", name, value)


_READERS = {"choice": _read_guided_choice, "json": _read_guided_json, "regex": _read_guided_regex,
            "grammar": _read_guided_grammar}


def _read_structured_outputs(name: str, value: Any) -> dict[str, Any]:
    """vLLM's ``structured_outputs``: one of ``json`` (a schema, or its JSON text), ``choice``,
    ``regex``, ``grammar`` or ``json_object: true``; ``disable_any_whitespace: true`` writes the JSON
    compact. ``structural_tag`` and ``whitespace_pattern`` are refused (not followed, they would look
    followed). ``disable_fallback`` (a backend's) and ``disable_additional_properties`` are read
    past (an object schema takes the properties JSON Schema lets it: close it with
    ``additionalProperties: false``)."""
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object, got {json_type(value)}", name)
    for key in value:
        if key in _STRUCTURED_REFUSED and value[key] not in (None, "", False):
            raise bad_request(f"{name}.{key} is not supported (json, choice and json_object are)", name)
        if key not in (*_STRUCTURED_KINDS, *_STRUCTURED_REFUSED, *_STRUCTURED_PASSED):
            raise bad_request(f"{name}.{key} is not one of its fields ({', '.join(_STRUCTURED_KINDS)}...)", name)
    kinds = [k for k in _STRUCTURED_KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(kinds) != 1:
        raise bad_request(f"{name} must hold one of {', '.join(_STRUCTURED_KINDS)}, got "
                          f"{' and '.join(kinds) if kinds else 'none'}", name)
    for key in _STRUCTURED_PASSED:
        if key in value and not isinstance(value[key], bool) and value[key] is not None:
            raise bad_request(f"{name}.{key} must be true or false, got {describe(value[key])}", name)
    kind = kinds[0]
    where = f"{name}.{kind}"
    if kind == "json_object":
        if value["json_object"] is not True:
            raise bad_request(f"{where} must be true, got {describe(value['json_object'])}", name)
        spec: dict[str, Any] = {"json_object": True}
    else:
        try:
            spec = _READERS[kind](where, value[kind])
        except APIError as exc:  # named by the part, for the message; the param is the field
            raise bad_request(exc.message, name) from None
    if value.get("disable_any_whitespace") and kind in ("json", "json_object"):
        spec = {**spec, "whitespace": False}
    return checked(spec, name, where)


def guided_text(response_format: dict[str, Any] | None, options: Any) -> dict[str, Any]:
    """``SamplingParams.guided`` (``response_format``'s ``FieldSpec.sampling``): the one guide
    ``options`` holds, whichever field it came in (or the one chat's tool_choice set), as JSON text
    (None: free text)."""
    held = (getattr(options, attr) for attr in (*GUIDE_FIELDS, "tool_guide"))
    spec = next((s for s in held if s is not None), None)
    return {"guided": None if spec is None else json.dumps(spec)}


_SCHEMA = {"type": "object", "description": "A JSON schema."}
RESPONSE_FORMAT = Custom(_read_response_format, {"oneOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "description": {"type": "string"}, "schema": _SCHEMA,
            "strict": {"type": ["boolean", "null"]}}}}},
]})
GUIDED_JSON = Custom(_read_guided_json, {"oneOf": [
    _SCHEMA, {"type": "string", "contentMediaType": "application/json", "description": "A JSON schema's text."},
]})
GUIDED_CHOICE = Custom(_read_guided_choice, {"type": "array", "items": {"type": "string", "minLength": 1},
                                             "minItems": 1})
GUIDED_REGEX = Custom(_read_guided_regex, {"type": "string", "minLength": 1, "maxLength": MAX_GUIDE_BYTES})
GUIDED_GRAMMAR = Custom(_read_guided_grammar, {"type": "string", "minLength": 1, "maxLength": MAX_GUIDE_BYTES})
STRUCTURED_OUTPUTS = Custom(_read_structured_outputs, {
    "type": "object",
    "properties": {
        "json": {"oneOf": [_SCHEMA, {"type": "string", "description": "A JSON schema's text."}]},
        "choice": {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        "json_object": {"type": "boolean"},
        "regex": {"type": "string", "minLength": 1},
        "grammar": {"type": "string", "minLength": 1},
        "disable_any_whitespace": {"type": "boolean"},
        "disable_fallback": {"type": "boolean"},
        "disable_additional_properties": {"type": "boolean"},
    },
})
