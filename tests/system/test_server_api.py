"""The OpenAI API against the real engine (``pagedserve serve`` with a tiny random Llama).

- sampling parameters that change the output as documented: seed, logit_bias, min_tokens,
  frequency_penalty, logprobs, through the official client, streamed and not;
- a fuzz run of at least 500 requests generated from /openapi.json (plus broken variants), on
  the generation, tokenize, embeddings, rerank and score routes, and from hand-written strategies
  on the Responses and Messages routes: never a 5xx, the server stays up, and every KV block is
  free afterwards;
- 50 streams cut after their first token: the scheduler aborts every one (its log says so), their
  blocks are freed and /metrics shows no running request.

Nothing here measures time: whether the engine stopped a request is read from the scheduler's log.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .api_fuzz import fuzz_request


pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 80
MODEL = "tiny"
NUM_FUZZ_REQUESTS = 500
FUZZ_BATCH_MIN = 5  # requests sent at once by one fuzz example (5 or 6)


@pytest.fixture(scope="module")
def tokenizer():
    from tests.doubles.fake_scheduler import cached_tokenizer

    return cached_tokenizer()


@pytest.fixture(scope="module")
def server(tiny_api_server):
    return tiny_api_server  # the session's (conftest.py), shared with test_server_groups


@pytest.fixture(scope="module")
def server_log(server, tmp_path_factory):
    """The server's log (every process's JSON lines, forwarded by the launcher)."""
    [log] = tmp_path_factory.getbasetemp().glob("serve-api[0-9]*/serve.log")  # tiny_server's folder
    return log


def engine_outcomes(log, request_ids: list[str], timeout: float = 60.0) -> dict[str, str]:
    """How the scheduler ended each request: "aborted", or the finish reason of its last output.
    Waits for all of them (the launcher forwards log lines a little later; the timeout only guards
    against a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        outcomes = {}
        for line in log.read_text().splitlines():
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("process") != "scheduler" or event.get("request_id") not in request_ids:
                continue
            if event["event"] == "request aborted":
                outcomes.setdefault(event["request_id"], "aborted")
            elif event["event"] == "request finished":
                outcomes.setdefault(event["request_id"], event["finish_reason"])
        if len(outcomes) == len(request_ids) or time.monotonic() > deadline:
            return outcomes
        time.sleep(0.2)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def wait_until_idle(url: str, timeout: float) -> float:
    """Seconds until /metrics shows no running or waiting request and no KV block in use."""
    started = time.monotonic()
    while True:
        m = metrics(url)
        idle = (m["pagedserve:num_requests_running"] == 0 and m["pagedserve:num_requests_waiting"] == 0
                and m["pagedserve:kv_cache_usage_perc"] == 0)
        elapsed = time.monotonic() - started
        if idle:
            return elapsed
        assert elapsed < timeout, f"not idle after {timeout} s: {m}"
        time.sleep(0.02)


# ---------------------------------------------------------------- parameters that change the output


def generate(client, kind: str, stream: bool, **fields) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of one request."""
    if kind == "chat":
        call = client.chat.completions.create
        fields = {"messages": [{"role": "user", "content": "Go on"}]} | fields
    else:
        call = client.completions.create
        fields = {"prompt": "Once upon a time"} | fields
    if not stream:
        result = call(model=MODEL, **fields)
        choice = result.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        return text, choice.finish_reason, result.usage.completion_tokens
    chunks = list(call(model=MODEL, stream=True, stream_options={"include_usage": True}, **fields))
    content = [c for c in chunks if c.choices]
    text = "".join((c.choices[0].delta.content or "") if kind == "chat" else c.choices[0].text for c in content)
    return text, content[-1].choices[0].finish_reason, chunks[-1].usage.completion_tokens


KINDS = pytest.mark.parametrize("kind, stream", [("completion", False), ("completion", True), ("chat", False),
                                                 ("chat", True)])


@KINDS
def test_seed_makes_sampling_reproducible(client, kind, stream):
    args = dict(temperature=1.0, max_tokens=12, extra_body={"ignore_eos": True})
    first = generate(client, kind, stream, seed=1234, **args)
    assert generate(client, kind, stream, seed=1234, **args) == first
    assert generate(client, kind, not stream, seed=1234, **args) == first  # streaming changes nothing
    assert generate(client, kind, stream, seed=4321, **args)[0] != first[0]


@KINDS
def test_logit_bias_forces_a_token(client, tokenizer, kind, stream):
    the = tokenizer.encode(" the")[0]
    text, finish, num = generate(client, kind, stream, temperature=1.0, max_tokens=6, logit_bias={str(the): 100},
                                 extra_body={"ignore_eos": True})
    assert (text, finish, num) == (" the" * 6, "length", 6)
    banned = generate(client, kind, stream, temperature=0.0, max_tokens=6, logit_bias={str(the): -100},
                      extra_body={"ignore_eos": True})[0]
    assert " the" not in banned or banned.count(" the") < 6


@KINDS
def test_min_tokens_holds_back_stop_tokens(client, tokenizer, kind, stream):
    stop_id = tokenizer.encode(" the")[0]
    forced = {"logit_bias": {str(stop_id): 100}}
    text, finish, num = generate(client, kind, stream, temperature=0.0, max_tokens=20,
                                 extra_body={"stop_token_ids": [stop_id]} | forced)
    assert (finish, num) == ("stop", 1)  # the biased stop token comes at once
    text, finish, num = generate(client, kind, stream, temperature=0.0, max_tokens=20,
                                 extra_body={"stop_token_ids": [stop_id], "min_tokens": 5} | forced)
    assert (finish, num) == ("stop", 6)  # banned for five tokens, then it stops


def test_frequency_penalty_breaks_a_repetition(client, tokenizer):
    the = tokenizer.encode(" the")[0]
    args = dict(temperature=0.0, max_tokens=12, logit_bias={str(the): 8}, extra_body={"ignore_eos": True})
    assert generate(client, "completion", False, **args)[0] == " the" * 12
    penalized = generate(client, "completion", False, frequency_penalty=2.0, **args)[0]
    assert penalized.count(" the") < 12
    assert generate(client, "completion", True, frequency_penalty=2.0, **args)[0] == penalized


def test_logprobs_of_greedy_tokens(client):
    result = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True})
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and max(top.values()) == pytest.approx(logprob) and token in top
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_generation_at_the_engine(server, server_log, client, tokenizer, stream):
    the = tokenizer.encode(" the")[0]
    args = dict(model=MODEL, prompt="Once upon a time", temperature=0.0, max_tokens=60, stop=["the the"],
                logit_bias={str(the): 100}, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **args))
        text = "".join(c.choices[0].text for c in chunks)
        request_id, finish = chunks[0].id, chunks[-1].choices[0].finish_reason
    else:
        result = client.completions.create(**args)
        request_id, text, finish = result.id, result.choices[0].text, result.choices[0].finish_reason
    assert (text, finish) == (" ", "stop")
    assert engine_outcomes(server_log, [request_id]) == {request_id: "aborted"}  # not left to run to 60 tokens
    wait_until_idle(server, timeout=60.0)


# ---------------------------------------------------------------- fuzzing (strategies: api_fuzz.py)


async def send(session: aiohttp.ClientSession, url: str, path: str, body, cut: bool) -> tuple[int, bytes]:
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with session.post(url + path, **kwargs) as resp:
        if cut and resp.status == 200:
            await resp.content.readline()
            return resp.status, b""  # leaving the block closes the connection mid-stream
        return resp.status, await resp.read()


def check_answer(path: str, body, status: int, raw: bytes) -> None:
    assert status < 500, (path, body, status, raw[:500])
    if not raw:
        return
    anthropic = path.startswith("/v1/messages")
    if status >= 400:
        error = json.loads(raw)
        if anthropic:  # Anthropic's shape
            assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, raw
        else:
            assert set(error["error"]) == {"message", "type", "param", "code"}, raw
        assert "executor failed" not in error["error"]["message"], (path, body, error)  # a bad request fails alone
        return
    streamed = (isinstance(body, dict) and body.get("stream") is True and path.startswith("/v1")
                and path != "/v1/messages/count_tokens")  # a count, whatever "stream" says
    if streamed and path in ("/v1/responses", "/v1/messages"):
        events = [json.loads(line[len("data: "):]) for line in raw.decode().splitlines() if line.startswith("data: ")]
        last = {"/v1/responses": ("response.completed", "response.incomplete"), "/v1/messages": ("message_stop",)}
        assert events and events[-1]["type"] in last[path], (body, events[-3:])
    elif streamed:
        text = raw.decode()
        assert text.endswith("data: [DONE]\n\n"), text[-300:]
        for event in text[:-2].split("\n\n")[:-1]:
            payload = json.loads(event[len("data: "):])
            assert "choices" in payload or "executor failed" not in payload["error"]["message"], (body, payload)
    else:
        json.loads(raw)


def test_fuzz_never_5xx_and_frees_every_block(server):
    import urllib.request

    with urllib.request.urlopen(f"{server}/openapi.json", timeout=5) as resp:
        spec = json.loads(resp.read())
    sent = []

    # batches of 5 or 6 concurrent requests: NUM_FUZZ_REQUESTS at least, with no more batches (each
    # an event loop, a session and its connections) than that takes
    @settings(max_examples=NUM_FUZZ_REQUESTS // FUZZ_BATCH_MIN, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(fuzz_request(spec, MODEL), min_size=FUZZ_BATCH_MIN, max_size=FUZZ_BATCH_MIN + 1))
    def run(requests):
        async def go():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                return await asyncio.gather(*(send(session, server, *r) for r in requests))

        for (path, body, _), (status, raw) in zip(requests, asyncio.run(go())):
            check_answer(path, body, status, raw)
            sent.append((path, status))

    run()
    assert len(sent) >= NUM_FUZZ_REQUESTS
    for route in ("/v1/responses", "/v1/messages"):  # their strategies reach both the answers and the refusals
        assert {200, 400} <= {status for path, status in sent if path == route}, (route, sent)
    wait_until_idle(server, timeout=60.0)
    with urllib.request.urlopen(f"{server}/health", timeout=5) as resp:
        assert resp.status == 200


# ---------------------------------------------------------------- disconnects


def test_fifty_cut_streams_are_aborted_and_free_their_blocks(server, server_log):
    wait_until_idle(server, timeout=60.0)
    before = metrics(server)
    finished_before = sum(v for k, v in before.items() if k.startswith("pagedserve:request_success_total"))
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 60, "stream": True, "ignore_eos": True,
            "temperature": 1.0}

    async def cut_after_first_token(session: aiohttp.ClientSession) -> str:
        async with session.post(server + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            chunk = json.loads((await resp.content.readline())[len(b"data: "):])
            assert chunk["choices"][0]["text"] is not None
        # leaving the block drops the connection: the server must abort the request
        return chunk["id"]

    async def go() -> list[str]:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await asyncio.gather(*(cut_after_first_token(session) for _ in range(50)))

    request_ids = asyncio.run(go())
    assert engine_outcomes(server_log, request_ids) == {r: "aborted" for r in request_ids}
    wait_until_idle(server, timeout=60.0)  # and their blocks are free
    after = metrics(server)
    finished_after = sum(v for k, v in after.items() if k.startswith("pagedserve:request_success_total"))
    assert finished_after == finished_before, "the streams finished on their own instead of being cut"
