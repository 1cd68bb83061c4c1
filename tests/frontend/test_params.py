"""Every parameter family through the official openai client, streamed and not (fake scheduler).

What the frontend sends to the scheduler is checked in ``fake.added``; logprobs come from the fake
(``fake_logprob``) so their shapes can be checked exactly.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.doubles.fake_scheduler import REPLY_TEXT, fake_logprob
from tests.doubles.http import http, sse_events
from tests.frontend.test_api import expected

MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "Tell me something."}]


def create(client, model, kind: str, stream: bool, **fields):
    """One request of ``kind``; returns (text of choice 0, finish reason, [chunks or the response])."""
    if kind == "chat":
        result = client.chat.completions.create(model=model.name, messages=MESSAGES, stream=stream, **fields)
    else:
        result = client.completions.create(model=model.name, prompt="Say it", stream=stream, **fields)
    if not stream:
        choice = result.choices[0]
        return (choice.message.content if kind == "chat" else choice.text), choice.finish_reason, [result]
    chunks = list(result)
    pieces = [(c.choices[0].delta.content or "") if kind == "chat" else c.choices[0].text for c in chunks if c.choices]
    return "".join(pieces), [c for c in chunks if c.choices][-1].choices[0].finish_reason, chunks


KINDS = pytest.mark.parametrize("kind, stream", [("completion", False), ("completion", True), ("chat", False),
                                                 ("chat", True)])


@KINDS
def test_sampling_family_reaches_the_scheduler(client, fake, model, kind, stream):
    text, finish, _ = create(client, model, kind, stream, temperature=0.7, top_p=0.8, seed=42, max_tokens=20,
                             extra_body={"top_k": 12, "min_p": 0.05})
    assert (text, finish) == expected(model, fake, 20)[::2]
    sent = fake.added[-1].sampling
    assert (sent.temperature, sent.top_p, sent.seed, sent.top_k, sent.min_p) == (0.7, 0.8, 42, 12, 0.05)


@KINDS
def test_penalties_and_logit_bias_reach_the_scheduler(client, fake, model, kind, stream):
    create(client, model, kind, stream, presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={"42": 5, "7": -100},
           max_tokens=5, extra_body={"repetition_penalty": 1.2})
    sent = fake.added[-1].sampling
    assert (sent.presence_penalty, sent.frequency_penalty, sent.repetition_penalty) == (0.5, -0.25, 1.2)
    assert dict(zip(sent.logit_bias_token_ids, sent.logit_bias_values)) == {42: 5.0, 7: -100.0}


@KINDS
def test_stop_family_reaches_the_scheduler(client, fake, model, kind, stream):
    text, finish, _ = create(client, model, kind, stream, stop=["東京"], max_tokens=100,
                             extra_body={"stop_token_ids": [3, 4], "ignore_eos": True, "min_tokens": 2})
    assert (text, finish) == (REPLY_TEXT[:REPLY_TEXT.index("東京")], "stop")
    sent = fake.added[-1].sampling
    assert (sent.stop_token_ids, sent.ignore_eos, sent.min_tokens) == ([3, 4], True, 2)
    assert sent.eos_token_ids == model.eos_token_ids  # for the min_tokens ban in the executor


def test_completion_logprobs(client, fake, model):
    result = client.completions.create(model=model.name, prompt="x", max_tokens=100, logprobs=2)
    logprobs = result.choices[0].logprobs
    ids, _ = fake.expected_reply(100, model.eos_token_ids[0])
    assert logprobs.token_logprobs == [fake_logprob(t) for t in ids]
    assert logprobs.tokens == [model.tokenizer.decode([t]) for t in ids]
    assert [list(top.values())[0] for top in logprobs.top_logprobs] == [fake_logprob(t) for t in ids]
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)  # two tokens may share a text
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    chunks = list(client.completions.create(model=model.name, prompt="x", max_tokens=100, logprobs=2, stream=True))
    streamed = [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == logprobs.token_logprobs
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == logprobs.text_offset
    assert fake.added[-1].sampling.logprobs == 2
    assert client.completions.create(model=model.name, prompt="x", max_tokens=3).choices[0].logprobs is None
    only_sampled = client.completions.create(model=model.name, prompt="x", max_tokens=3, logprobs=0).choices[0]
    assert [list(top.values()) for top in only_sampled.logprobs.top_logprobs] == [  # the sampled token is always in
        [lp] for lp in only_sampled.logprobs.token_logprobs]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_with_exact_bytes(client, fake, model, stream):
    args = dict(model=model.name, messages=MESSAGES, max_tokens=100, logprobs=True, top_logprobs=3)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **args))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        content = client.chat.completions.create(**args).choices[0].logprobs.content
    ids, finish = fake.expected_reply(100, model.eos_token_ids[0])
    assert finish == "stop" and len(content) == len(ids)
    assert [e.logprob for e in content] == [fake_logprob(t) for t in ids]
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob for e in content)
    # A byte-level token may hold part of a character: the bytes add up exactly, the texts need not.
    assert b"".join(bytes(e.bytes) for e in content[:-1]).decode() == REPLY_TEXT  # the last one is EOS
    assert fake.added[-1].sampling.logprobs == 3
    plain = client.chat.completions.create(model=model.name, messages=MESSAGES, max_tokens=3, logprobs=True)
    assert plain.choices[0].logprobs.content[0].top_logprobs == [] and fake.added[-1].sampling.logprobs == 0


@pytest.mark.parametrize("stream", [False, True])
def test_echo(client, fake, model, stream):
    prompt = "Echo this: 東京"
    prompt_ids = model.tokenizer.encode(prompt)
    num_prompt = len(prompt_ids)
    args = dict(model=model.name, prompt=prompt, max_tokens=5, echo=True, logprobs=0)
    if stream:
        chunks = list(client.completions.create(stream=True, **args))
        assert chunks[0].choices[0].text == prompt
        text = "".join(c.choices[0].text for c in chunks)
        token_logprobs = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    else:
        choice = client.completions.create(**args).choices[0]
        text, token_logprobs = choice.text, choice.logprobs.token_logprobs
    assert text == prompt + expected(model, fake, 5)[0]
    # the prompt's tokens with the engine's scores (the first has nothing before it), then the reply's
    assert token_logprobs[:num_prompt] == [None] + [fake_logprob(t) for t in prompt_ids[1:]]
    assert None not in token_logprobs[num_prompt:] and fake.added[-1].sampling.prompt_logprobs == 0
    assert len(token_logprobs) == num_prompt + 5
    token_ids = model.tokenizer.encode("Hi there")
    assert client.completions.create(model=model.name, prompt=token_ids, max_tokens=2,
                                      echo=True).choices[0].text.startswith("Hi there")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", [["one", "two words", "three"], [[1, 2], [3], [4, 5, 6]]])
def test_several_prompts_are_several_choices(client, fake, model, prompt, stream):
    num_before = len(fake.added)
    if stream:
        chunks = list(client.completions.create(model=model.name, prompt=prompt, max_tokens=7, stream=True,
                                                stream_options={"include_usage": True}))
        texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                 for i in range(3)}
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert len({c.id for c in chunks}) == 1
    else:
        result = client.completions.create(model=model.name, prompt=prompt, max_tokens=7)
        assert [c.index for c in result.choices] == [0, 1, 2]
        texts = {c.index: c.text for c in result.choices}
        finishes = [c.finish_reason for c in result.choices]
        usage = result.usage
    sent = fake.added[num_before:]
    assert len(sent) == 3 and len({r.request_id for r in sent}) == 3
    by_index = sorted(sent, key=lambda r: r.request_id)
    assert [r.prompt_token_ids.tolist() for r in by_index] == [
        p if isinstance(p, list) else model.tokenizer.encode(p) for p in prompt]
    assert texts == {i: expected(model, fake, 7)[0] for i in range(3)} and finishes == ["length"] * 3
    assert usage.completion_tokens == 21
    assert usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in sent)


@pytest.mark.parametrize("field, value, fragment", [
    ("n", 200, "n must be between 1 and 128"),
    ("best_of", 200, "best_of must be between 1 and 128"),
    ("logprobs", 50, "between 0 and 20"),
    ("logit_bias", {"999999999": 1}, "out of range"),
    ("presence_penalty", 3, "between -2 and 2"),
    ("prompt", ["a", [1]], "a list of strings"),
])
def test_refusals_through_the_client(client, model, field, value, fragment):
    fields = {"prompt": "hi", "max_tokens": 3} | {field: value}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model.name, **{k: v for k, v in fields.items() if k != "n"},
                                  **({"n": value} if field == "n" else {}))
    assert info.value.param == field and fragment in info.value.message


@pytest.mark.parametrize("payload, param, fragment", [
    (b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", None, "not valid JSON"),
    (b'{"prompt": "hi", "temperature": 1e999}', "temperature", "finite number"),
    (b'{"prompt": "hi", "logit_bias": {"1": true}}', "logit_bias", "got boolean"),
    (b'{"prompt": "hi", "top_k": 100000000000000000000000}', None, None),
    (b'{"prompt": "hi", "max_tokens": 100000000000000000000000}', "max_tokens", "maximum context length"),
    (b'{"prompt": "hi", "min_tokens": 100000000000000000000000}', "min_tokens", "min_tokens must not exceed max_tokens (16)"),
    (b'{"prompt": "hi", "seed": 100000000000000000000000}', "seed", "64 bits"),
    (b'{"prompt": "hi", "stream_options": {"include_usage": true}}', "stream_options", "only allowed"),
    (b'{"prompt": "\\ud800"}', None, "lone UTF-16 surrogate"),
    (b'{"prompt": "\\ud83d\\ude80"}', None, None),  # a pair is one character
    (b'\xff\xfe{}', None, "not valid JSON"),
])
def test_malformed_raw_http(frontend, payload, param, fragment):
    status, headers, raw = http("POST", frontend.base_url + "/v1/completions", data=payload)
    body = json.loads(raw)
    if fragment is None:  # accepted or refused, but never a 5xx
        assert status in (200, 400), body
        return
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and fragment in body["error"]["message"], body


def test_streamed_raw_sse_with_several_prompts_and_logprobs(frontend, model):
    body = {"model": model.name, "prompt": ["a", "b"], "max_tokens": 4, "stream": True, "logprobs": 1}
    status, _, raw = http("POST", frontend.base_url + "/v1/completions", body=body)
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert sum(len(c["logprobs"]["tokens"]) for c in mine) == 4 and mine[-1]["finish_reason"] == "length"
