"""n, best_of and beam search through the OpenAI API against the real engine (``pagedserve serve``
with a tiny random Llama): choice counts, reproducibility, greedy agreement, and every KV block
free afterwards."""

from __future__ import annotations

import pytest

from tests.system.test_server_api import MODEL, metrics, wait_until_idle

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
IGNORE_EOS = {"ignore_eos": True}  # a random model may end at any token; fixed lengths are easier to check


@pytest.fixture(scope="module")
def server(tiny_api_server):
    """test_server_api's server (conftest.py): the same model, length and pool; its
    --max-queue-len 200 is far above what these tests queue."""
    return tiny_api_server


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def texts(result) -> list[str]:
    assert [c.index for c in result.choices] == list(range(len(result.choices)))
    return [c.message.content if hasattr(c, "message") else c.text for c in result.choices]


def test_seeded_n_is_reproducible(client):
    args = dict(model=MODEL, prompt=PROMPT, n=3, temperature=1.0, seed=1234, max_tokens=8, extra_body=IGNORE_EOS)
    first = client.completions.create(**args)
    assert len(first.choices) == 3 and first.usage.completion_tokens == 24
    assert all(c.finish_reason == "length" for c in first.choices)
    assert len(set(texts(first))) > 1  # each choice samples its own stream
    assert texts(client.completions.create(**args)) == texts(first)
    chunks = list(client.completions.create(stream=True, **args))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(3)}
    assert streamed == dict(enumerate(texts(first)))


def test_greedy_n_gives_identical_choices(client):
    args = dict(model=MODEL, temperature=0, max_tokens=8, extra_body=IGNORE_EOS)
    one = texts(client.completions.create(prompt=PROMPT, **args))
    assert texts(client.completions.create(prompt=PROMPT, n=3, **args)) == one * 3
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], n=3, **args)
    assert len(set(texts(chat))) == 1 and len(chat.choices) == 3


def test_best_of_returns_n_choices(client):
    result = client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=3, temperature=1.0, seed=7,
                                       max_tokens=6, logprobs=1, extra_body=IGNORE_EOS)
    assert len(result.choices) == 2 and result.usage.completion_tokens == 12
    totals = [sum(c.logprobs.token_logprobs) for c in result.choices]
    assert all(len(c.logprobs.tokens) == 6 for c in result.choices) and totals[0] >= totals[1] - 1e-3


@pytest.mark.parametrize("stream", [False, True])
def test_beam_search_returns_up_to_n_hypotheses(client, stream):
    args = dict(model=MODEL, temperature=0, max_tokens=6)
    greedy = texts(client.completions.create(prompt=PROMPT, extra_body=IGNORE_EOS, **args))[0]
    result = client.completions.create(prompt=PROMPT, n=3, stream=stream,
                                       extra_body={"use_beam_search": True, **IGNORE_EOS}, **args)
    if stream:
        chunks = [c for c in result if c.choices]
        assert [c.choices[0].index for c in chunks] == list(range(len(chunks)))  # one chunk per hypothesis
        choices = [c.choices[0] for c in chunks]
    else:
        choices = result.choices
    assert 1 <= len(choices) <= 3 and all(c.finish_reason == "length" for c in choices)
    assert len({c.text for c in choices}) == len(choices)  # distinct hypotheses
    width_one = client.completions.create(prompt=PROMPT, n=1, extra_body={"use_beam_search": True, **IGNORE_EOS},
                                          **args)
    assert texts(width_one) == [greedy]
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=6,
                                          model=MODEL, extra_body={"use_beam_search": True, "length_penalty": 0.0})
    assert 1 <= len(chat.choices) <= 3 and all(c.finish_reason in ("stop", "length") for c in chat.choices)


def test_every_block_is_free_afterwards(server, client):
    wait_until_idle(server, timeout=60.0)
    m = metrics(server)
    assert m["pagedserve:kv_cache_usage_perc"] == 0 and m["pagedserve:num_requests_running"] == 0
    assert m["pagedserve:num_requests_waiting"] == 0
