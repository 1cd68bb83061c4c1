"""Structured outputs in the request: OpenAI's ``response_format`` and vLLM's ``guided_json`` /
``guided_choice`` / ``guided_regex`` / ``guided_grammar`` / ``structured_outputs`` on both routes,
read into the guide spec that reaches ``SamplingParams.guided`` as JSON text, and every shape we
cannot follow refused with a 400 naming its field and, for a schema, regex or grammar llguidance
refuses, saying where (llguidance's message)."""

from __future__ import annotations

import json

import pydantic
import pytest

from services.frontend.openapi import openapi_spec
from shared.structured import MAX_GUIDE_BYTES
from services.frontend.preprocess import sampling_params
from tests.doubles.http import http
from tests.frontend.test_fields import chat, completion, refused, to_engine

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city"], "additionalProperties": False}
BOTH = pytest.mark.parametrize("parse", [completion, chat], ids=["completions", "chat"])


def guided(body, model) -> dict | None:
    """The guide spec a parsed body sends the engine (``SamplingParams.guided``, read back)."""
    text = sampling_params(body.options, 3, model, None, "prompt").guided
    return None if text is None else json.loads(text)


def json_schema_format(**json_schema) -> dict:
    return {"type": "json_schema", "json_schema": json_schema}


# ---------------------------------------------------------------- accepted


@BOTH
def test_each_accepted_shape_reaches_the_engine_as_its_guide(parse, model):
    assert guided(parse(response_format={"type": "json_object"}), model) == {"json_object": True}
    full = json_schema_format(name="city", schema=SCHEMA, strict=True, description="A city.")
    assert guided(parse(response_format=full), model) == {"json_schema": SCHEMA}
    assert guided(parse(response_format=json_schema_format(name="x", strict=None)), model) == {"json_schema": {}}
    assert guided(parse(guided_json=SCHEMA), model) == {"json_schema": SCHEMA}
    assert guided(parse(guided_json=json.dumps(SCHEMA)), model) == {"json_schema": SCHEMA}
    assert guided(parse(guided_choice=["yes", "no", "maybe"]), model) == {"choice": ["yes", "no", "maybe"]}
    assert guided(parse(guided_regex=r"[a-z]+\d?"), model) == {"regex": r"[a-z]+\d?"}
    assert guided(parse(guided_grammar='root ::= "a" | "b"'), model) == {"grammar": 'root ::= "a" | "b"'}
    assert guided(parse(guided_json={"type": "string", "format": "email", "pattern": "^a"}), model) == {
        "json_schema": {"type": "string", "format": "email", "pattern": "^a"}}  # llguidance follows both
    text = {"type": "text"}
    assert guided(parse(response_format=text, guided_choice=["a"]), model) == {"choice": ["a"]}  # text: no guide
    assert guided(parse(response_format={"type": "json_object"}, n=2, best_of=3), model) == {"json_object": True}


@BOTH
def test_free_text_without_a_guide(parse, model):
    for fields in ({}, {"response_format": {"type": "text"}}, {"response_format": None, "guided_json": None}):
        body = parse(**fields)
        assert sampling_params(body.options, 3, model, None, "prompt").guided is None, fields


def test_the_guide_text_is_what_the_executor_compiles(model):
    from shared.structured import compile_guide

    text = sampling_params(chat(guided_json=SCHEMA).options, 3, model, None, "prompt").guided
    assert isinstance(text, str) and compile_guide(json.loads(text)) is not None


# ---------------------------------------------------------------- refused


@BOTH
@pytest.mark.parametrize("value, fragments", [
    ("json", ["response_format must be an object, got string"]),
    ({}, ["response_format.type must be one of text, json_object, json_schema, got nothing"]),
    ({"type": "xml"}, ["response_format.type must be one of", 'got string "xml"']),
    ({"type": "json_schema"}, ["response_format.json_schema must be an object", "got nothing"]),
    ({"type": "json_schema", "json_schema": "x"}, ["response_format.json_schema must be an object", "got string"]),
    (json_schema_format(schema=SCHEMA), ["response_format.json_schema.name must be a string", "got nothing"]),
    (json_schema_format(name=3, schema=SCHEMA), ["name must be a string", "got number"]),
    (json_schema_format(name="x", schema=[SCHEMA]), ["json_schema.schema must be a JSON schema (an object)"]),
    (json_schema_format(name="x", schema={"type": "string", "pattern": "^(a+$"}),
     ["response_format.json_schema: ", "regex parse error: unclosed group"]),  # (the rest is llguidance's)
    (json_schema_format(name="x", schema={"$ref": "#/$defs/Missing"}), ["'/$defs/Missing' does not exist"]),
    (json_schema_format(name="x", schema={"type": "colour"}), ["Invalid type: colour"]),
])
def test_a_response_format_we_cannot_follow_is_refused(parse, value, fragments):
    refused(lambda: parse(response_format=value), "response_format", *fragments)


@BOTH
@pytest.mark.parametrize("field, value, fragments", [
    ("guided_json", "{not json", ["guided_json is a string but not valid JSON"]),
    ("guided_json", '{"const": NaN}', ["not valid JSON", "NaN"]),
    ("guided_json", 5, ["guided_json must be a JSON schema (an object, or its JSON text), got number"]),
    ("guided_json", "[1]", ["must be a JSON schema", "got array"]),
    ("guided_json", {"type": "string", "format": "colour"}, ["guided_json: ", "Unknown format: colour"]),
    ("guided_choice", [], ["guided_choice must be a non-empty list of strings, got array []"]),
    ("guided_choice", "yes", ["must be a non-empty list of strings, got string"]),
    ("guided_choice", ["yes", ""], ["guided_choice[1] must be a non-empty string"]),
    ("guided_choice", ["yes", 3], ["guided_choice[1] must be a non-empty string, got number 3"]),
    ("guided_choice", [f"c{i}" for i in range(12000)], [f"over the limit of {MAX_GUIDE_BYTES} bytes"]),
    ("guided_regex", "[a-z+", ["guided_regex: ", "unclosed character class"]),
    ("guided_regex", "", ["guided_regex must be a non-empty string (a regex), got string"]),
    ("guided_regex", ["a"], ["guided_regex must be a non-empty string"]),
    ("guided_regex", "a" * (MAX_GUIDE_BYTES + 1), [f"over the limit of {MAX_GUIDE_BYTES} bytes"]),
    ("guided_grammar", 'root ::= "a" ( ', ["guided_grammar: GBNF: Expected ')' at line 1"]),
    ("guided_grammar", 'root ::= "a" foo', ["guided_grammar: GBNF: Rule 'foo' not found"]),
    ("guided_grammar", 'start: "a" | b', ["guided_grammar: at 1(8): unknown name: \"b\""]),
    ("guided_grammar", 7, ["guided_grammar must be a non-empty string (a grammar), got number"]),
])
def test_a_vllm_guide_we_cannot_follow_is_refused(parse, field, value, fragments):
    refused(lambda: parse(**{field: value}), field, *fragments)


def test_a_schema_nested_past_the_compiler_is_a_400_not_a_crash():
    deep: dict = {}
    inner = deep
    for _ in range(400):
        inner["items"] = {}
        inner = inner["items"]
    refused(lambda: chat(guided_json=deep), "guided_json", "recursion limit exceeded")
    chain = {"$defs": {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(3000)}
             | {"d3000": {"type": "string"}}, "$ref": "#/$defs/d0"}
    refused(lambda: chat(response_format=json_schema_format(name="x", schema=chain)), "response_format",
            f"over the limit of {MAX_GUIDE_BYTES} bytes")


@BOTH
def test_one_guide_per_request(parse):
    json_object = {"type": "json_object"}
    refused(lambda: parse(response_format=json_object, guided_choice=["a"]), "guided_choice",
            "guided_choice cannot be combined with response_format")
    refused(lambda: parse(guided_json=SCHEMA, guided_choice=["a"]), "guided_choice",
            "guided_choice cannot be combined with guided_json")
    refused(lambda: parse(response_format=json_object, guided_json=SCHEMA), "guided_json",
            "give one of response_format, guided_json, guided_choice, guided_regex, guided_grammar or "
            "structured_outputs")
    refused(lambda: parse(guided_regex="a", guided_grammar='root ::= "a"'), "guided_grammar",
            "guided_grammar cannot be combined with guided_regex")


@BOTH
def test_no_guide_with_beam_search(parse, model):
    for field, value in (("response_format", {"type": "json_object"}), ("guided_json", SCHEMA),
                         ("guided_choice", ["a", "b"]), ("guided_regex", "a+")):
        refused(lambda: to_engine(parse, model, use_beam_search=True, n=2, **{field: value}), field,
                f"{field} is not supported with use_beam_search")
    assert parse(use_beam_search=True, n=2, response_format={"type": "text"}).options.use_beam_search


def test_openapi_describes_the_guides_on_both_routes():
    schemas = openapi_spec("0", "m", False)["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        properties = schemas[request]["properties"]
        assert [o["properties"]["type"] for o in properties["response_format"]["oneOf"]] == [
            {"enum": ["text", "json_object"]}, {"const": "json_schema"}]
        assert "json_schema" in properties["response_format"]["description"]
        assert [o["type"] for o in properties["guided_json"]["oneOf"]] == ["object", "string"]
        assert properties["guided_choice"]["items"] == {"type": "string", "minLength": 1}
        assert properties["guided_regex"]["type"] == properties["guided_grammar"]["type"] == "string"
        assert set(properties["structured_outputs"]["properties"]) >= {"json", "choice", "regex", "grammar"}


# ---------------------------------------------------------------- over HTTP, with the openai client


def test_the_openai_client_shapes_reach_the_engine(client, fake, model):
    response_format = json_schema_format(name="city", schema=SCHEMA, strict=True)
    result = client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "A city?"}],
                                            max_tokens=4, response_format=response_format)
    assert result.choices[0].finish_reason == "length"
    assert json.loads(fake.added[-1].sampling.guided) == {"json_schema": SCHEMA}
    client.completions.create(model=model.name, prompt="Yes or no?", max_tokens=2,
                              extra_body={"guided_choice": ["yes", "no"]})
    assert json.loads(fake.added[-1].sampling.guided) == {"choice": ["yes", "no"]}
    client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert fake.added[-1].sampling.guided is None


class City(pydantic.BaseModel):
    name: str
    population: int | None


class Answer(pydantic.BaseModel):
    cities: list[City]


def test_the_openai_clients_parse_sends_a_schema_we_follow(client, fake, model):
    """``parse(response_format=Model)`` sends the model's strict schema ($defs, $ref, anyOf, titles);
    the fake engine answers free text, so only the client's own parsing of it fails."""
    num_added = len(fake.added)
    with pytest.raises(pydantic.ValidationError):
        client.chat.completions.parse(model=model.name, response_format=Answer,
                                      messages=[{"role": "user", "content": "Two cities?"}])
    assert len(fake.added) == num_added + 1
    spec = json.loads(fake.added[-1].sampling.guided)
    assert spec["json_schema"]["properties"]["cities"]["items"] == {"$ref": "#/$defs/City"}
    assert spec["json_schema"]["$defs"]["City"]["additionalProperties"] is False


def test_a_bad_schema_is_a_400_in_openai_shape_and_the_service_goes_on(frontend, fake):
    url = frontend.base_url + "/v1/chat/completions"
    messages = [{"role": "user", "content": "Hi"}]
    num_added = len(fake.added)
    bad = json_schema_format(name="x", schema={"type": "string", "pattern": "^(a$"})
    status, _, raw = http("POST", url, body={"messages": messages, "response_format": bad})
    error = json.loads(raw)["error"]
    assert status == 400 and (error["type"], error["param"]) == ("invalid_request_error", "response_format")
    assert "unclosed group" in error["message"] and set(error) == {"message", "type", "param", "code"}
    status, _, raw = http("POST", frontend.base_url + "/v1/completions",
                          body={"prompt": "Hi", "guided_choice": ["yes", 7], "stream": True})
    assert status == 400 and json.loads(raw)["error"]["param"] == "guided_choice"
    assert len(fake.added) == num_added  # neither reached the engine
    status, _, raw = http("POST", url, body={"messages": messages, "max_tokens": 2,
                                             "response_format": {"type": "json_object"}})
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length"
    assert json.loads(fake.added[-1].sampling.guided) == {"json_object": True}


# ---------------------------------------------------------------- vLLM's structured_outputs


@BOTH
def test_vllms_structured_outputs(parse, model):
    assert guided(parse(structured_outputs={"json": SCHEMA}), model) == {"json_schema": SCHEMA}
    assert guided(parse(structured_outputs={"json": json.dumps(SCHEMA), "disable_fallback": True}), model) == {
        "json_schema": SCHEMA}
    assert guided(parse(structured_outputs={"choice": ["a", "b"], "regex": None}), model) == {"choice": ["a", "b"]}
    assert guided(parse(structured_outputs={"json_object": True, "disable_any_whitespace": True}), model) == {
        "json_object": True, "whitespace": False}
    assert guided(parse(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False}), model) == {
        "json_schema": SCHEMA}
    assert guided(parse(guided_json=SCHEMA, guided_decoding_backend="xgrammar"), model) == {"json_schema": SCHEMA}
    assert guided(parse(structured_outputs={"regex": "a+"}), model) == {"regex": "a+"}
    assert guided(parse(structured_outputs={"grammar": 'root ::= "a"', "disable_any_whitespace": True}), model) == {
        "grammar": 'root ::= "a"'}
    for value, fragment in (({"regex": "a[+"}, "structured_outputs.regex: "),
                            ({"grammar": 'root ::= "a" foo'}, "structured_outputs.grammar: GBNF: Rule 'foo' not found"),
                            ({"json": SCHEMA, "grammar": "root ::= x"}, "got json and grammar"),
                            ({"structural_tag": "x"}, "structured_outputs.structural_tag is not supported"),
                            ({"json": SCHEMA, "choice": ["a"]}, "got json and choice"),
                            ({}, "got none"), ({"json_object": "yes"}, "json_object must be true"),
                            ({"json": {"type": "strin"}}, "structured_outputs.json: Invalid type: strin"),
                            ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
                            ({"jsn": SCHEMA}, "structured_outputs.jsn is not one of its fields"),
                            ({"json": SCHEMA, "disable_any_whitespace": "yes"}, "must be true or false"),
                            ("x", "structured_outputs must be an object")):
        refused(lambda: parse(structured_outputs=value), "structured_outputs", fragment)
    refused(lambda: parse(structured_outputs={"json": SCHEMA}, guided_choice=["a"]), "structured_outputs",
            "cannot be combined with guided_choice")
    refused(lambda: to_engine(parse, model, use_beam_search=True, n=2, structured_outputs={"choice": ["a"]}),
            "structured_outputs",
            "not supported with use_beam_search")
    refused(lambda: parse(guided_whitespace_pattern=r"\s*"), "guided_whitespace_pattern", "")


def test_structured_outputs_with_a_falsy_guide_says_what_it_got():
    refused(lambda: chat(structured_outputs={"json": 0}), "structured_outputs", "structured_outputs.json")


def test_the_frontend_keeps_its_verdicts_on_specs_it_has_compiled():
    from shared.messages.sampling_rules import guide_error as _compile_error

    schema = {"type": "object", "properties": {"kept": {"type": "integer"}}}
    before = _compile_error.cache_info()
    for _ in range(3):
        chat(guided_json=schema)
        refused(lambda: chat(guided_json={"type": "string", "format": "kept"}), "guided_json", "Unknown format: kept")
    after = _compile_error.cache_info()
    assert after.misses - before.misses == 2 and after.hits - before.hits == 4
