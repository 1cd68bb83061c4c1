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
    Route, declare, declared_fields, read_declared, sampling_values, schema_properties,
)
from services.frontend.openapi import openapi_spec
from services.frontend.options import GenerationOptions
from services.frontend.preprocess import sampling_params
from services.frontend.request_body import ChatBody, CompletionBody, parse_chat_body, parse_completion_body
from shared.messages import AddRequest, SamplingParams, decode, encode
from tests.doubles.fake_scheduler import REPLY_TEXT, fake_logprob, fake_rank
from tests.doubles.http import http, sse_events

MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return parse_completion_body({"prompt": "Hello"} | fields, "m")


def chat(**fields):
    return parse_chat_body({"messages": MESSAGES} | fields, "m")


def to_engine(parse, model, **fields):
    """A body's ``SamplingParams``, as the routes build them (the rulebook checks them there)."""
    return sampling_params(parse(**fields).options, 3, model, 16, "prompt")


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
    later: int | None = declare(Integer(minimum=0), pending="not yet")
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
    settled_by_the_model |= {"pooling"}  # embeddings_engine: the embedding routes' own requests
    derived = set(sampling_values(GenerationOptions()))
    assert derived | settled_by_the_model == {f.name for f in dataclasses.fields(SamplingParams)}
    assert not derived & settled_by_the_model


def test_prompt_logprobs_reach_the_engine_with_echoed_logprobs_folded_in(model):
    for parse in (completion, chat):
        assert parse(prompt_logprobs=None).options.prompt_logprobs is None
        assert parse(prompt_logprobs=2).options.prompt_logprobs == 2
        refused(lambda: parse(prompt_logprobs=-1), "prompt_logprobs", "between 0 and 20, got -1")
        refused(lambda: parse(prompt_logprobs="2"), "prompt_logprobs", "must be an integer")
        refused(lambda: parse(prompt_logprobs=0, stream=True), "prompt_logprobs", "not available with stream")
        refused(lambda: to_engine(parse, model, prompt_logprobs=1, use_beam_search=True, n=2), "prompt_logprobs",
                "prompt_logprobs is not supported with use_beam_search")

    def engine_top(echo: bool, **fields) -> int | None:
        options = completion(echo=echo, **fields).options
        return sampling_params(options, 3, model, 16, "prompt", echo=echo).prompt_logprobs

    assert engine_top(False, prompt_logprobs=3) == engine_top(True, prompt_logprobs=3) == 3
    assert engine_top(False) is engine_top(True) is engine_top(False, logprobs=2) is None
    assert engine_top(True, logprobs=2) == 2  # echo with logprobs: OpenAI's way to score the prompt
    assert engine_top(True, logprobs=4, prompt_logprobs=1) == engine_top(True, logprobs=1, prompt_logprobs=4) == 4
    params = sampling_params(completion(prompt_logprobs=3).options, 3, model, 16, "prompt")
    request = AddRequest("r", np.array([1, 2, 3], np.int32), params, 0.0)
    assert decode(encode(request)).sampling == params


def test_max_tokens_zero_only_on_completions_with_echo(model):
    assert completion(max_tokens=0, echo=True).options.max_tokens == 0
    refused(lambda: completion(max_tokens=0), "max_tokens", "max_tokens must be at least 1, got 0", "with echo")
    refused(lambda: completion(max_tokens=-1, echo=True), "max_tokens", "at least 1, got -1")
    refused(lambda: chat(max_tokens=0), "max_tokens", "max_tokens must be at least 1, got 0")
    refused(lambda: chat(max_completion_tokens=0), "max_completion_tokens", "at least 1, got 0")
    refused(lambda: to_engine(completion, model, max_tokens=0, echo=True, min_tokens=1), "min_tokens",
            "min_tokens must not exceed max_tokens (0), got 1")


# ---------------------------------------------------------------- prompt scoring, served


def expected_prompt_logprobs(prompt_ids: list[int]) -> list[float | None]:
    """The fake scheduler's scores of a prompt, as the legacy ``token_logprobs`` shows them."""
    return [None] + [fake_logprob(t) for t in prompt_ids[1:]]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_and_max_tokens_zero_scores_the_prompt(client, fake, model, stream):
    """What a harness that scores answers sends (lm-eval's ``local-completions``): the prompt comes
    back with its tokens and the engine's logprobs for them (``null`` first), nothing generated."""
    prompts = ["Score this: 東京", "And this."]
    prompt_ids = [list(model.tokenizer.encode(p)) for p in prompts]
    num_before = len(fake.added)
    args = dict(model=model.name, prompt=prompts, max_tokens=0, echo=True, logprobs=1, n=2)
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
        choices = [c.choices[0] for c in chunks if c.choices]
        texts = {i: "".join(c.text for c in choices if c.index == i) for i in range(4)}
        finishes = {c.index: c.finish_reason for c in choices if c.finish_reason}
        echoed = {c.index: c.logprobs for c in choices if c.text}  # the echo chunk: one per choice
        assert len([c for c in choices if c.text]) == 4
        usage = chunks[-1].usage
    else:
        result = client.completions.create(**args)
        texts = {c.index: c.text for c in result.choices}
        finishes = {c.index: c.finish_reason for c in result.choices}
        echoed = {c.index: c.logprobs for c in result.choices}
        usage = result.usage
    assert texts == {i: prompts[i // 2] for i in range(4)} and finishes == {i: "length" for i in range(4)}
    for index, logprobs in echoed.items():
        ids = prompt_ids[index // 2]
        assert logprobs.token_logprobs == expected_prompt_logprobs(ids)
        assert logprobs.tokens == [model.tokenizer.decode([t]) for t in ids]
        assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))]
        assert logprobs.top_logprobs[0] is None
        for token_id, top in zip(ids[1:], logprobs.top_logprobs[1:]):  # the top 1, then the prompt token
            want = {model.tokenizer.decode([token_id + 1]): fake_logprob(token_id) - 1}
            want.setdefault(model.tokenizer.decode([token_id]), fake_logprob(token_id))  # unless one text
            assert top == want
    assert (usage.prompt_tokens, usage.completion_tokens) == (sum(map(len, prompt_ids)), 0)
    sent = fake.added[num_before:]
    assert [r.prompt_token_ids.tolist() for r in sent] == prompt_ids
    assert all((r.sampling.max_tokens, r.sampling.prompt_logprobs, r.sampling.n) == (0, 1, 2) for r in sent)


def test_streamed_echo_with_logprobs_opens_with_the_prompts_then_generates(client, fake, model):
    prompt_ids = list(model.tokenizer.encode("Hello"))
    chunks = list(client.completions.create(model=model.name, prompt="Hello", max_tokens=4, echo=True, logprobs=0,
                                            stream=True))
    first, *rest = [c.choices[0] for c in chunks]
    assert first.text == "Hello" and first.logprobs.token_logprobs == expected_prompt_logprobs(prompt_ids)
    generated = fake.reply_token_ids[:4]
    assert "".join(c.text for c in rest) == model.tokenizer.decode(generated)
    assert [lp for c in rest if c.logprobs for lp in c.logprobs.token_logprobs] == [fake_logprob(t) for t in generated]
    offsets = [o for c in [first, *rest] if c.logprobs for o in c.logprobs.text_offset]
    tokens = [t for c in [first, *rest] if c.logprobs for t in c.logprobs.tokens]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]  # one running offset


def test_echo_without_logprobs_and_max_tokens_zero_never_reaches_the_engine(client, fake, model):
    num_before = len(fake.added)
    result = client.completions.create(model=model.name, prompt=["One", "Two"], max_tokens=0, echo=True)
    assert [(c.text, c.finish_reason, c.logprobs) for c in result.choices] == [("One", "length", None),
                                                                               ("Two", "length", None)]
    assert len(fake.added) == num_before


def vllm_prompt_logprobs(model, prompt_ids: list[int], num_top: int) -> list:
    """vLLM's ``prompt_logprobs`` of the fake scheduler's scores, as JSON brings them back."""
    entries = [None]
    for t in prompt_ids[1:]:
        ranked = {str(t): {"logprob": fake_logprob(t), "rank": fake_rank(t),
                           "decoded_token": model.tokenizer.decode([t])}}
        for r in range(num_top):
            ranked[str(t + 1 + r)] = {"logprob": fake_logprob(t) - 1 - r, "rank": r + 1,
                                      "decoded_token": model.tokenizer.decode([t + 1 + r])}
        entries.append(ranked)
    return entries


def test_vllm_prompt_logprobs_per_choice_on_completions_and_once_on_chat(client, fake, model):
    prompt_ids = list(model.tokenizer.encode("Score me"))
    result = client.completions.create(model=model.name, prompt="Score me", max_tokens=2, n=2,
                                       extra_body={"prompt_logprobs": 2})
    want = vllm_prompt_logprobs(model, prompt_ids, 2)
    assert [c.model_extra["prompt_logprobs"] for c in result.choices] == [want, want]
    assert [c.logprobs for c in result.choices] == [None, None]  # prompt_logprobs alone lists no token logprobs
    echoed = client.completions.create(model=model.name, prompt="Score me", max_tokens=0, echo=True, logprobs=1,
                                       extra_body={"prompt_logprobs": 3})
    assert fake.added[-1].sampling.prompt_logprobs == 3  # the larger; each view keeps its own
    assert echoed.choices[0].model_extra["prompt_logprobs"] == vllm_prompt_logprobs(model, prompt_ids, 3)
    assert all(len(top) == 2 for top in echoed.choices[0].logprobs.top_logprobs[1:])
    chat = client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    chat_ids = fake.added[-1].prompt_token_ids.tolist()
    assert chat.model_extra["prompt_logprobs"] == vllm_prompt_logprobs(model, chat_ids, 0)
    assert "prompt_logprobs" not in chat.choices[0].model_extra
    plain = client.completions.create(model=model.name, prompt="Score me", max_tokens=1)
    assert "prompt_logprobs" not in plain.choices[0].model_extra and fake.added[-1].sampling.prompt_logprobs is None


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
