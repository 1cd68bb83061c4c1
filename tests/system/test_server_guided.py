"""Structured outputs through ``pagedserve serve`` and the official openai client: ``response_format``
(a JSON schema, a pydantic model through ``parse``, any JSON object) and vLLM's ``guided_choice``, on
the tiny random model in float32, whose output only the guide keeps in shape. Greedy output equals
the offline engine's for the same model and prompt (the server's overlapped loop against the
offline engine's lock-step one)."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest

from services.offline import LLM
from shared.messages import SamplingParams
from tests.executor.test_guided_decoding import SCHEMA, conforms

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


def test_a_schema_it_cannot_follow_is_a_400_and_the_server_goes_on(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                       response_format=schema_format({"type": "string", "pattern": "^a+$"}))
    assert "'pattern' is not supported" in str(info.value)
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
