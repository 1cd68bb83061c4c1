"""The one declaration of the request fields and what is derived from it: parsing, the 400s,
/openapi.json and ``SamplingParams``; and the prompt-scoring surface (``max_tokens`` 0 with
``echo``, ``prompt_logprobs``)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from services.frontend.errors import APIError
from services.frontend.field_kinds import Boolean, Integer, Number
from services.frontend.fields import (
    BeamSearch, Route, declare, declared_fields, read_declared, sampling_values, schema_properties,
)
from services.frontend.openapi import openapi_spec
from services.frontend.options import GenerationOptions
from services.frontend.preprocess import sampling_params
from services.frontend.request_body import ChatBody, CompletionBody, parse_chat_body, parse_completion_body
from shared.messages import AddRequest, SamplingParams, decode, encode
from tests.frontend_doubles import REPLY_TEXT
from tests.test_frontend_api import http, sse_events

MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return parse_completion_body({"prompt": "Hello"} | fields, "m")


def chat(**fields):
    return parse_chat_body({"messages": MESSAGES} | fields, "m")


def refused(fn, param, *fragments):
    with pytest.raises(APIError) as info:
        fn()
    assert info.value.status == 400 and info.value.param == param, info.value.message
    for fragment in fragments:
        assert fragment in info.value.message, info.value.message
    return info.value


# ---------------------------------------------------------------- the declaration machinery


@dataclasses.dataclass
class Toy:
    """A request with a field of each sort, declared the way ``GenerationOptions`` declares its own."""

    width: int = declare(Integer(1, 8), 2, sampling=True, description="How wide.")
    scale: float = declare(Number(0.0, 1.0, exclusive_minimum=True), 1.0, aliases=("new_scale",),
                           alias_routes=Route.CHAT)
    loud: bool = declare(Boolean(), False, routes=Route.COMPLETIONS, json_name="shout")
    volume: int | None = declare(Integer(minimum=0), nullable=True, requires="loud", routes=Route.COMPLETIONS)
    later: int | None = declare(Integer(minimum=0), pending="not yet", beam_search=BeamSearch.REFUSED)
    given: dict = dataclasses.field(default_factory=dict)


def test_a_declared_field_is_read_checked_described_and_converted():
    toy = read_declared(Toy, {"width": 3.0, "shout": True, "volume": 4, "unknown": 1}, Route.COMPLETIONS)
    assert (toy.width, toy.scale, toy.loud, toy.volume) == (3, 1.0, True, 4)
    assert toy.given == {"width": "width", "loud": "shout", "volume": "volume"}
    chat_toy = read_declared(Toy, {"new_scale": 0.5, "scale": 0.25, "shout": "ignored on chat"}, Route.CHAT)
    assert (chat_toy.scale, chat_toy.loud, chat_toy.given) == (0.5, False, {"scale": "new_scale"})  # the alias wins
    refused(lambda: read_declared(Toy, {"width": 9}, Route.CHAT), "width", "width must be between 1 and 8, got 9")
    refused(lambda: read_declared(Toy, {"scale": 0}, Route.CHAT), "scale", "scale must be in (0, 1], got 0.0")
    refused(lambda: read_declared(Toy, {"new_scale": "x"}, Route.CHAT), "new_scale", "must be a number, got string")
    refused(lambda: read_declared(Toy, {"volume": 1}, Route.COMPLETIONS), "volume",
            "volume is only allowed when loud is true")
    refused(lambda: read_declared(Toy, {"later": 1}, Route.CHAT), "later", "later is not supported yet: not yet")
    assert read_declared(Toy, {"later": None, "width": None}, Route.CHAT).width == 2  # null is "left out"

    properties, required = schema_properties(Toy, Route.CHAT)
    assert set(properties) == {"width", "scale", "new_scale", "later"} and required == []
    assert properties["width"] == {"type": "integer", "minimum": 1, "maximum": 8, "default": 2,
                                   "description": "How wide."}
    assert properties["scale"] == {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1}
    properties, _ = schema_properties(Toy, Route.COMPLETIONS)
    assert properties["shout"] == {"type": "boolean", "default": False}
    assert properties["volume"] == {"type": ["integer", "null"], "minimum": 0}
    assert sampling_values(toy) == {"width": 3}
    assert [d.attr for d in declared_fields(Toy, Route.CHAT)] == ["width", "scale", "later"]


# ---------------------------------------------------------------- the real declaration


def test_openapi_lists_each_declared_field_on_its_routes_only():
    schemas = openapi_spec("0", "m", False)["components"]["schemas"]
    for body_cls, route, schema in ((CompletionBody, Route.COMPLETIONS, "CompletionRequest"),
                                    (ChatBody, Route.CHAT, "ChatCompletionRequest")):
        properties, required = schema_properties(body_cls, route)
        assert schemas[schema]["properties"] == properties and schemas[schema]["required"] == required
    completions = schemas["CompletionRequest"]["properties"]
    chats = schemas["ChatCompletionRequest"]["properties"]
    assert {"prompt", "echo", "logprobs", "prompt_logprobs", "temperature", "best_of"} <= set(completions)
    assert {"messages", "max_completion_tokens", "top_logprobs", "logprobs", "prompt_logprobs"} <= set(chats)
    assert not {"messages", "top_logprobs", "max_completion_tokens"} & set(completions)
    assert not {"prompt", "echo", "suffix"} & set(chats)
    assert completions["logprobs"]["type"] == ["integer", "null"] and chats["logprobs"]["type"] == "boolean"
    assert completions["max_tokens"]["minimum"] == 0  # with echo
    assert chats["max_tokens"]["minimum"] == chats["max_completion_tokens"]["minimum"] == 1
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]


def test_every_sampling_params_field_comes_from_a_declaration():
    """A field added to ``SamplingParams`` needs a declaration (or a line in ``sampling_params``)."""
    settled_by_the_model = {"max_tokens", "eos_token_ids"}  # preprocess.sampling_params
    derived = set(sampling_values(GenerationOptions()))
    assert derived | settled_by_the_model == {f.name for f in dataclasses.fields(SamplingParams)}
    assert not derived & settled_by_the_model


def test_prompt_logprobs_is_declared_but_refused_until_the_engine_computes_them(model):
    for parse in (completion, chat):
        assert parse(prompt_logprobs=None).options.prompt_logprobs is None
        refused(lambda: parse(prompt_logprobs=2), "prompt_logprobs", "prompt_logprobs is not supported yet",
                "the engine does not compute prompt logprobs")
        refused(lambda: parse(prompt_logprobs=-1), "prompt_logprobs", "between 0 and 20, got -1")
        refused(lambda: parse(prompt_logprobs="2"), "prompt_logprobs", "must be an integer")
    options = completion().options
    options.prompt_logprobs = 3  # what the body will carry once the engine computes them
    params = sampling_params(options, 3, model, 16, "prompt")
    assert params.prompt_logprobs == 3
    request = AddRequest("r", np.array([1, 2, 3], np.int32), params, [2], 0.0)
    assert decode(encode(request)).sampling == params


def test_max_tokens_zero_only_on_completions_with_echo():
    assert completion(max_tokens=0, echo=True).options.max_tokens == 0
    refused(lambda: completion(max_tokens=0), "max_tokens", "max_tokens must be at least 1, got 0", "with echo")
    refused(lambda: completion(max_tokens=-1, echo=True), "max_tokens", "at least 1, got -1")
    refused(lambda: chat(max_tokens=0), "max_tokens", "max_tokens must be at least 1, got 0")
    refused(lambda: chat(max_completion_tokens=0), "max_completion_tokens", "at least 1, got 0")
    refused(lambda: completion(max_tokens=0, echo=True, min_tokens=1), "min_tokens", "must not exceed max_tokens (0)")


# ---------------------------------------------------------------- echo with max_tokens 0, served


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_zero_returns_the_prompt_alone(client, fake, model, stream):
    """What a harness that scores answers sends: the prompt comes back with its tokens, nothing is
    generated, and nothing reaches the engine (prompt logprobs are ``null`` until it computes them)."""
    prompts = ["Score this: 東京", "And this."]
    num_prompt_tokens = [len(model.tokenizer.encode(p)) for p in prompts]
    num_before = len(fake.added)
    args = dict(model=model.name, prompt=prompts, max_tokens=0, echo=True, logprobs=1, n=2)
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
        texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                 for i in range(4)}
        finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                    if c.choices and c.choices[0].finish_reason}
        logprobs = {i: [lp for c in chunks if c.choices and c.choices[0].index == i and c.choices[0].logprobs
                        for lp in c.choices[0].logprobs.token_logprobs] for i in range(4)}
        usage = chunks[-1].usage
    else:
        result = client.completions.create(**args)
        texts = {c.index: c.text for c in result.choices}
        finishes = {c.index: c.finish_reason for c in result.choices}
        logprobs = {c.index: c.logprobs.token_logprobs for c in result.choices}
        tokens = result.choices[0].logprobs.tokens
        assert tokens == [model.tokenizer.decode([t]) for t in model.tokenizer.encode(prompts[0])]
        usage = result.usage
    assert texts == {i: prompts[i // 2] for i in range(4)} and finishes == {i: "length" for i in range(4)}
    assert logprobs == {i: [None] * num_prompt_tokens[i // 2] for i in range(4)}
    assert (usage.prompt_tokens, usage.completion_tokens) == (sum(num_prompt_tokens), 0)
    assert len(fake.added) == num_before


def test_echo_with_max_tokens_zero_and_without_echo_over_http(frontend, model, fake):
    url = frontend.base_url + "/v1/completions"
    status, _, raw = http("POST", url, body={"prompt": "Hi", "max_tokens": 0})
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"
    status, _, raw = http("POST", url, body={"prompt": "Hi", "max_tokens": 0, "echo": True, "stream": True})
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert [(c["text"], c["finish_reason"], c["logprobs"]) for c in choices] == [("Hi", None, None), ("", "length", None)]
    status, _, raw = http("POST", url, body={"prompt": "Hi", "max_tokens": 1, "echo": True})
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "Hi" + model.tokenizer.decode(
        model.tokenizer.encode(REPLY_TEXT)[:1])
