"""Structured outputs through ``pagedserve serve`` and the official openai client: ``response_format``
(a JSON schema, a pydantic model through ``parse``, any JSON object), vLLM's ``guided_choice``,
``guided_regex``, ``guided_grammar`` and ``structured_outputs`` (``extra_body``), on the tiny random
model in float32, whose output only the guide keeps in shape (checked by ``re``, ``ast`` and
``jsonschema``). Greedy output equals the offline engine's for the same model and prompt (the
server's overlapped loop against the offline engine's lock-step one)."""

from __future__ import annotations

import ast
import json
import re

import openai
import pydantic
import pytest

from services.offline import LLM
from shared.messages import SamplingParams
from tests.executor.test_guided_decoding import REGEX, SCHEMA, SHORT_ARITHMETIC, conforms

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Describe a thing as JSON."}]


@pytest.fixture(scope="module")
def client(tiny_f32_server):
    url, _ = tiny_f32_server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}


def test_greedy_json_schema_equals_the_offline_engine(client, tiny_model_dir):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=150,
                                              response_format=schema_format(SCHEMA))
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    [offline] = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=150,
                                                  guided=json.dumps({"json_schema": SCHEMA})))
    choice = response.choices[0]
    assert choice.message.content == offline.choices[0].text
    assert choice.finish_reason == offline.choices[0].finish_reason
    if choice.finish_reason == "stop":
        assert conforms(json.loads(choice.message.content))


def test_sampled_choices_and_streams_follow_the_schema(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=5, n=6,
                                              max_tokens=150, response_format=schema_format(SCHEMA))
    finished = [c for c in response.choices if c.finish_reason == "stop"]
    assert len(finished) >= 4, [c.finish_reason for c in response.choices]
    assert all(conforms(json.loads(c.message.content)) for c in finished)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=6, max_tokens=150,
                                            response_format=schema_format(SCHEMA), stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop":
        assert conforms(json.loads(text))


class Verdict(pydantic.BaseModel):
    label: str = pydantic.Field(max_length=6)
    score: int
    sure: bool


def test_the_sdks_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model="tiny", messages=MESSAGES, temperature=0, max_tokens=150,
                                               response_format=Verdict)
    message = completion.choices[0].message
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(message.parsed, Verdict)
        assert Verdict.model_validate_json(message.content) == message.parsed


def test_json_object_and_guided_choice(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=150,
                                              response_format={"type": "json_object"})
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].message.content), dict)
    completion = client.completions.create(model="tiny", prompt="The colour is", temperature=1.0, seed=2, n=4,
                                           max_tokens=10, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in completion.choices)


def test_regex_and_grammar_guides_in_both_of_vllms_shapes(client):
    regex = client.completions.create(model="tiny", prompt="Code:", temperature=1.0, seed=3, n=4, max_tokens=40,
                                      extra_body={"guided_regex": REGEX})
    grammar = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=4, n=4,
                                             max_tokens=40, extra_body={"guided_grammar": SHORT_ARITHMETIC})
    nested = client.completions.create(model="tiny", prompt="Sum:", temperature=1.0, seed=5, n=2, max_tokens=40,
                                       extra_body={"structured_outputs": {"grammar": SHORT_ARITHMETIC}})
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=6, max_tokens=40,
                                            stream=True, extra_body={"structured_outputs": {"regex": REGEX}})
    chunks = [c for c in stream if c.choices]
    texts = [(c.text, c.finish_reason, "regex") for c in regex.choices]
    texts += [(c.message.content, c.finish_reason, "grammar") for c in grammar.choices]
    texts += [(c.text, c.finish_reason, "grammar") for c in nested.choices]
    texts.append(("".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason,
                  "regex"))
    finished = [(text, kind) for text, reason, kind in texts if reason == "stop"]
    assert len(finished) >= 6, texts
    for text, kind in finished:
        if kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert isinstance(ast.parse(text, mode="eval"), ast.Expression), text


@pytest.mark.parametrize("extra, param, fragment", [
    ({"response_format": schema_format({"type": "string", "pattern": "^(a+$"})}, "response_format", "unclosed group"),
    ({"extra_body": {"guided_regex": "[0-9"}}, "guided_regex", "guided_regex: at 1(8): invalid regex"),
    ({"extra_body": {"guided_grammar": 'root ::= "a" num'}}, "guided_grammar", "Rule 'num' not found"),
    ({"extra_body": {"structured_outputs": {"grammar": 'start: "a" | b'}}}, "structured_outputs",
     'structured_outputs.grammar: at 1(8): unknown name: "b"'),
    ({"extra_body": {"guided_regex": "a" * 70000}}, "guided_regex", "over the limit of 65536 bytes"),
])
def test_a_guide_it_cannot_follow_is_a_400_and_the_server_goes_on(client, extra, param, fragment):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, **extra)
    assert info.value.status_code == 400 and info.value.body["param"] == param
    assert fragment in info.value.body["message"], info.value.body
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
