"""Several choices per prompt on the frontend: n, best_of, beam search (fake scheduler, openai client).

The fake scheduler answers like the real one (see ``FakeScheduler``): ``n`` choices interleaved,
``best_of`` samples held back and the best ``n`` sent at the end, beam hypotheses sent at the end.
"""

from __future__ import annotations

import json

import openai
import pytest

from services.frontend.errors import APIError
from services.frontend.preprocess import sampling_params
from services.frontend.request_body import parse_chat_body, parse_completion_body
from tests.doubles.fake_scheduler import FEW_BEAMS_MARKER, SLOW_MARKER
from tests.doubles.http import http, sse_events

MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "Tell me something."}]


def reply(model, fake, max_tokens: int, choice_idx: int) -> tuple[str, int, str]:
    """(text, tokens, finish_reason) of the fake's choice ``choice_idx``."""
    ids, finish = fake.expected_reply(max_tokens, model.eos_token_ids[0], choice_idx)
    return model.tokenizer.decode(ids, skip_special_tokens=True), len(ids), finish


def call(client, model, kind: str, stream: bool, **fields):
    if kind == "chat":
        return client.chat.completions.create(model=model.name, messages=MESSAGES, stream=stream, **fields)
    return client.completions.create(model=model.name, prompt="Say it", stream=stream, **fields)


def collect(chunks, kind: str) -> tuple[dict[int, str], dict[int, list[str]], list]:
    """Per choice index: the text and the finish reasons of a stream's chunks; and the usage chunks."""
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        assert len(chunk.choices) <= 1
        for c in chunk.choices:
            piece = (c.delta.content or "") if kind == "chat" else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finishes.setdefault(c.index, []).append(c.finish_reason)
    return texts, finishes, [c for c in chunks if not c.choices]


def text_of(choice, kind: str) -> str:
    return choice.message.content if kind == "chat" else choice.text


KINDS = pytest.mark.parametrize("kind", ["completion", "chat"])


# ---------------------------------------------------------------- n


@KINDS
def test_n_three_whole_and_streamed(client, model, fake, kind):
    want = [reply(model, fake, 30, c) for c in range(3)]
    num_before = len(fake.added)
    whole = call(client, model, kind, False, n=3, max_tokens=30)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [(text_of(c, kind), c.finish_reason) for c in whole.choices] == [(t, f) for t, _, f in want]
    assert whole.usage.completion_tokens == sum(n for _, n, _ in want)
    sent = fake.added[num_before:]
    assert len(sent) == 1 and sent[0].sampling.n == 3 and sent[0].sampling.best_of is None  # one engine request

    chunks = list(call(client, model, kind, True, n=3, max_tokens=30, stream_options={"include_usage": True}))
    texts, finishes, usage = collect(chunks, kind)
    assert texts == {c.index: text_of(c, kind) for c in whole.choices}
    assert finishes == {i: [f] for i, (_, _, f) in enumerate(want)}  # one finish per choice
    assert len(usage) == 1 and usage[0].usage.completion_tokens == whole.usage.completion_tokens
    if kind == "chat":
        roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
        assert roles == [0, 1, 2] and all(c.choices[0].delta.role for c in chunks[:3])


def test_several_prompts_index_by_prompt_then_choice(frontend, client, model, fake):
    result = client.completions.create(model=model.name, prompt=["one", "two"], n=2, max_tokens=6)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    want = [reply(model, fake, 6, c)[0] for c in range(2)]
    assert [c.text for c in result.choices] == want * 2
    assert result.usage.completion_tokens == 4 * 6
    body = {"model": model.name, "prompt": ["one", "two"], "n": 2, "max_tokens": 6, "stream": True, "echo": True}
    status, _, raw = http("POST", frontend.base_url + "/v1/completions", body=body)
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert status == 200
    texts: dict[int, str] = {}
    for chunk in chunks:
        c = chunk["choices"][0]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {0: "one" + want[0], 1: "one" + want[1], 2: "two" + want[0], 3: "two" + want[1]}


def test_stop_string_ends_only_its_choice(client, model, fake):
    num_aborted = len(fake.aborted)
    result = client.completions.create(model=model.name, prompt="Say it", n=3, max_tokens=60, stop=["(1)"])
    full = [reply(model, fake, 60, c) for c in range(3)]
    assert [(c.text, c.finish_reason) for c in result.choices] == [full[0][:1] + ("stop",), ("", "stop"),
                                                                   full[2][:1] + ("stop",)]
    assert full[0][2] == full[2][2] == "stop"  # those two ended at EOS, not at the stop string
    assert len(fake.aborted) == num_aborted  # the engine finished every choice: nothing to abort


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_in_every_choice_aborts_the_request_once(client, model, fake, stream):
    num_aborted = len(fake.aborted)
    result = client.completions.create(model=model.name, prompt=f"{SLOW_MARKER} go", n=3, max_tokens=200,
                                       stop=["STOP"], stream=stream)  # 4 s of tokens: the engine still runs
    if stream:
        chunks = list(result)
        texts, finishes, _ = collect(chunks, "completion")
        finishes = {i: f[0] for i, f in finishes.items()}
        indices = [c.choices[0].index for c in chunks if c.choices]
        assert indices != sorted(indices)  # interleaved as they arrive
    else:
        texts = {c.index: c.text for c in result.choices}
        finishes = {c.index: c.finish_reason for c in result.choices}
    for c in range(3):
        full = reply(model, fake, 60, c)[0]
        assert texts[c] == full[:full.index("STOP")]
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    assert fake.wait_for(lambda f: len(f.aborted) == num_aborted + 1)
    assert fake.aborted[-1] == fake.added[-1].request_id
    assert not fake.wait_for(lambda f: len(f.aborted) > num_aborted + 1, timeout=0.2)


def test_cut_stream_with_n_aborts_the_request(frontend, model, fake):
    import asyncio

    import aiohttp

    body = {"model": model.name, "prompt": f"{SLOW_MARKER} go", "n": 3, "max_tokens": 200, "stream": True}

    async def go():
        async with aiohttp.ClientSession() as session:
            async with session.post(frontend.base_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readline()

    asyncio.run(go())
    assert fake.wait_for(lambda f: f.added and f.added[-1].request_id in f.aborted)


# ---------------------------------------------------------------- best_of


@KINDS
def test_best_of_returns_the_best_n_at_the_end(client, model, fake, kind):
    num_before = len(fake.added)
    result = call(client, model, kind, False, n=2, max_tokens=12, extra_body={"best_of": 4} if kind == "chat" else {},
                  **({"best_of": 4} if kind == "completion" else {}))
    sampling = fake.added[num_before].sampling
    assert (sampling.n, sampling.best_of) == (2, 4)
    want = [reply(model, fake, 12, c) for c in (3, 2)]  # the fake's "most likely" samples
    assert [(c.index, text_of(c, kind), c.finish_reason) for c in result.choices] == [
        (0, want[0][0], want[0][2]), (1, want[1][0], want[1][2])]
    assert result.usage.completion_tokens == want[0][1] + want[1][1]  # returned choices only
    assert all(c.logprobs is None for c in result.choices)


def test_best_of_with_logprobs_and_equal_to_n(client, model, fake):
    result = client.completions.create(model=model.name, prompt="Say it", n=1, best_of=3, max_tokens=5, logprobs=1)
    assert len(result.choices) == 1 and len(result.choices[0].logprobs.tokens) == 5
    assert result.choices[0].text == reply(model, fake, 5, 2)[0]
    num_before = len(fake.added)
    chunks = list(client.completions.create(model=model.name, prompt="Say it", n=2, best_of=2, max_tokens=5,
                                            stream=True))  # best_of == n streams as plain n
    assert fake.added[num_before].sampling.best_of is None
    assert collect(chunks, "completion")[0] == {c: reply(model, fake, 5, c)[0] for c in range(2)}


# ---------------------------------------------------------------- beam search


@KINDS
@pytest.mark.parametrize("stream", [False, True])
def test_beam_search_request_and_reply_shapes(client, model, fake, kind, stream):
    num_before = len(fake.added)
    extra = {"use_beam_search": True, "length_penalty": 0.5, "early_stopping": "never"}
    result = call(client, model, kind, stream, n=3, max_tokens=12, temperature=0, extra_body=extra)
    chunks = list(result) if stream else None
    sampling = fake.added[num_before].sampling
    assert (sampling.n, sampling.use_beam_search, sampling.length_penalty, sampling.early_stopping) == (
        3, True, 0.5, "never")
    assert sampling.temperature == 0.0 and sampling.best_of is None
    want = {c: reply(model, fake, 12, c) for c in range(3)}
    if not stream:
        assert [(c.index, text_of(c, kind), c.finish_reason) for c in result.choices] == [
            (i, t, f) for i, (t, _, f) in want.items()]
        assert result.usage.completion_tokens == sum(n for _, n, _ in want.values())
        return
    texts, finishes, _ = collect(chunks, kind)
    assert texts == {i: t for i, (t, _, _) in want.items()} and finishes == {i: [f] for i, (_, _, f) in want.items()}
    content = [c for c in chunks if c.choices and (c.choices[0].delta.content if kind == "chat" else True)]
    assert [c.choices[0].index for c in content] == [0, 1, 2]  # each hypothesis in one chunk, best first
    if kind == "chat":  # each opens with its role just before its text
        assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks] == [
            (i, r) for i in range(3) for r in ("assistant", None)]


@pytest.mark.parametrize("stream", [False, True])
def test_beam_search_with_fewer_hypotheses_than_n(client, model, fake, stream):
    result = client.completions.create(model=model.name, prompt=f"{FEW_BEAMS_MARKER} go", n=3, max_tokens=8,
                                       stream=stream, extra_body={"use_beam_search": True},
                                       **({"stream_options": {"include_usage": True}} if stream else {}))
    want = reply(model, fake, 8, 0)
    if stream:
        texts, finishes, usage = collect(list(result), "completion")
        assert texts == {0: want[0]} and finishes == {0: [want[2]]}
        assert usage[0].usage.completion_tokens == want[1]
    else:
        assert [(c.index, c.text) for c in result.choices] == [(0, want[0])]
        assert result.usage.completion_tokens == want[1]


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("fields, param, fragment", [
    ({"n": 0}, "n", "n must be between 1 and 128, got 0"),
    ({"n": 129}, "n", "between 1 and 128"),
    ({"n": 2.5}, "n", "must be an integer"),
    ({"n": True}, "n", "must be an integer"),
    ({"best_of": 2, "n": 3}, "best_of", "best_of must be greater than or equal to n, got best_of=2 and n=3"),
    ({"best_of": 300}, "best_of", "between 1 and 128"),
    ({"best_of": 3, "stream": True}, "best_of", "best_of cannot be used with stream"),
    ({"use_beam_search": 1}, "use_beam_search", "must be a boolean"),
    ({"length_penalty": 2.0}, "length_penalty", "applies only with use_beam_search"),
    ({"length_penalty": 11, "use_beam_search": True}, "length_penalty", "between -10 and 10"),
    ({"early_stopping": True}, "early_stopping", "applies only with use_beam_search"),
    ({"early_stopping": "always", "use_beam_search": True}, "early_stopping", "true, false or \"never\""),
    ({"use_beam_search": True, "temperature": 0.7}, "temperature", "temperature must be 0"),
    ({"use_beam_search": True, "top_p": 0.5}, "top_p", "not supported with use_beam_search"),
    ({"use_beam_search": True, "logit_bias": {"5": 1}}, "logit_bias", "not supported with use_beam_search"),
    ({"use_beam_search": True, "min_tokens": 2}, "min_tokens", "not supported with use_beam_search"),
    ({"use_beam_search": True, "logprobs": 2}, "logprobs", "not supported with use_beam_search"),
    ({"use_beam_search": True, "n": 2, "best_of": 4}, "best_of", "must equal n"),
])
def test_completion_refusals_name_their_param(frontend, model, fields, param, fragment):
    status, _, raw = http("POST", frontend.base_url + "/v1/completions",
                          body={"model": model.name, "prompt": "hi", "max_tokens": 3} | fields)
    error = json.loads(raw)["error"]
    assert status == 400 and (error["param"], error["type"]) == (param, "invalid_request_error")
    assert fragment in error["message"], error["message"]


def test_chat_refusals_and_openai_client_errors(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model.name, messages=MESSAGES, n=2, logprobs=True,
                                       extra_body={"use_beam_search": True})
    assert info.value.param == "logprobs" and "use_beam_search" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model.name, prompt="hi", n=2, best_of=4, stream=True)
    assert info.value.param == "best_of"


def test_parsed_fields_reach_sampling_params(model):
    def params(parse, **fields):
        body = parse({"model": model.name} | fields, model.name)
        return sampling_params(body.options, 3, model, 16, "prompt")

    sp = params(parse_completion_body, prompt="x", n=4, best_of=6, seed=3)
    assert (sp.n, sp.best_of, sp.use_beam_search, sp.length_penalty, sp.early_stopping) == (4, 6, False, 1.0, False)
    sp = params(parse_completion_body, prompt="x", n=4, best_of=4)
    assert (sp.n, sp.best_of) == (4, None)  # nothing to hold back
    sp = params(parse_chat_body, messages=MESSAGES, n=2, use_beam_search=True, length_penalty=-0.5,
                early_stopping=True)
    assert (sp.n, sp.use_beam_search, sp.length_penalty, sp.early_stopping, sp.temperature) == (
        2, True, -0.5, True, 0.0)
    sp = params(parse_chat_body, messages=MESSAGES, best_of=3)
    assert (sp.n, sp.best_of) == (1, 3)
    with pytest.raises(APIError):
        params(parse_chat_body, messages=MESSAGES, n=1, best_of=2, stream=True)
