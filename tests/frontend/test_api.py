"""The frontend end to end: real aiohttp app and ZMQ sockets, a fake scheduler, the openai client."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.frontend.app import error_middleware
from tests.doubles.http import http, sse_events, wait_for_health
from tests.doubles.fake_scheduler import ERROR_MARKER, MALFORMED_MARKER, REPLY_TEXT, SLOW_MARKER

MAX_MODEL_LEN = 128
MAX_BODY_BYTES = 1 << 20


def expected(model, fake, max_tokens: int) -> tuple[str, int, str]:
    """(text, completion_tokens, finish_reason) the fake scheduler's reply should produce."""
    ids, finish = fake.expected_reply(max_tokens, model.eos_token_ids[0])
    return model.tokenizer.decode(ids, skip_special_tokens=True), len(ids), finish


def chat_prompt_len(model, messages) -> int:
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return len(ids)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about 🚀 and 東京."}]


# ---------------------------------------------------------------- models and health


def test_models_and_health(client, frontend, fake, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model.name]
    assert models.data[0].owned_by == "pagedserve"
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(model.name).id == model.name
    health = wait_for_health(frontend.base_url, 200)
    assert health["status"] == "ok"
    # the fake's EngineStats carry 0 slots used and 0 allocated: /health passes this moment's on
    assert (health["num_slots_used"], health["num_slots_allocated"]) == (0, 0)
    fake.ready = False
    try:
        assert wait_for_health(frontend.base_url, 503)["status"] == "unavailable"
    finally:
        fake.ready = True
    wait_for_health(frontend.base_url, 200)


# ---------------------------------------------------------------- non-streamed


def test_completion_defaults_to_16_tokens(client, fake, model):
    result = client.completions.create(model=model.name, prompt="Say something")
    text, num_tokens, finish = expected(model, fake, 16)
    assert (result.choices[0].text, result.choices[0].finish_reason) == (text, "length")
    assert result.id.startswith("cmpl-") and result.object == "text_completion"
    assert result.usage.prompt_tokens == len(model.tokenizer.encode("Say something"))
    assert result.usage.completion_tokens == num_tokens == 16
    assert result.usage.total_tokens == result.usage.prompt_tokens + 16
    sent = fake.added[-1]
    assert sent.request_id == result.id
    assert sent.prompt_token_ids.tolist() == model.tokenizer.encode("Say something")
    assert sent.sampling.max_tokens == 16 and sent.sampling.eos_token_ids == model.eos_token_ids


def test_completion_runs_to_eos_and_passes_sampling(client, fake, model):
    result = client.completions.create(
        model=model.name, prompt=[1, 2, 3], max_tokens=100, temperature=0.3, top_p=0.9, seed=11,
        extra_body={"top_k": 20, "min_tokens": 1, "ignore_eos": False, "stop_token_ids": [5]},
    )
    text, num_tokens, finish = expected(model, fake, 100)
    assert finish == "stop" and text == REPLY_TEXT
    assert (result.choices[0].text, result.choices[0].finish_reason) == (REPLY_TEXT, "stop")
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, num_tokens)  # EOS counted
    sampling = fake.added[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.seed, sampling.top_k) == (0.3, 0.9, 11, 20)
    assert (sampling.min_tokens, sampling.stop_token_ids, sampling.max_tokens) == (1, [5], 100)


def test_chat_defaults_to_the_rest_of_the_context(client, fake, model):
    result = client.chat.completions.create(model=model.name, messages=MESSAGES)
    num_prompt = chat_prompt_len(model, MESSAGES)
    text, num_tokens, finish = expected(model, fake, MAX_MODEL_LEN - num_prompt)
    assert result.id.startswith("chatcmpl-") and result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert (result.choices[0].message.content, result.choices[0].finish_reason) == (text, finish)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (num_prompt, num_tokens)
    assert fake.added[-1].sampling.max_tokens == MAX_MODEL_LEN - num_prompt


# ---------------------------------------------------------------- streamed


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("max_tokens", [10, 60])
def test_streamed_equals_non_streamed(client, model, kind, max_tokens):
    if kind == "chat":
        create, args = client.chat.completions.create, {"messages": MESSAGES, "max_completion_tokens": max_tokens}
    else:
        create, args = client.completions.create, {"prompt": "Once upon a time", "max_tokens": max_tokens}
    whole = create(model=model.name, **args)
    chunks = list(create(model=model.name, stream=True, stream_options={"include_usage": True}, **args))
    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert all(c.usage is None for c in content_chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id
    finish = [c.choices[0].finish_reason for c in content_chunks]
    assert finish[-1] in ("stop", "length") and not any(finish[:-1])
    if kind == "chat":
        assert content_chunks[0].choices[0].delta.role == "assistant"
        assert content_chunks[0].choices[0].delta.content == ""
        streamed = "".join(c.choices[0].delta.content or "" for c in content_chunks)
        assert streamed == whole.choices[0].message.content
    else:
        streamed = "".join(c.choices[0].text for c in content_chunks)
        assert streamed == whole.choices[0].text
    assert finish[-1] == whole.choices[0].finish_reason


@pytest.mark.parametrize("path, body, obj", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 12}, "text_completion"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "chat.completion.chunk"),
])
def test_sse_framing(frontend, model, path, body, obj):
    status, headers, raw = http("POST", frontend.base_url + path, body={"model": model.name, "stream": True} | body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == obj and "usage" not in c for c in chunks)  # no include_usage: no usage key
    assert chunks[-1]["choices"][0]["finish_reason"] is not None
    if obj == "chat.completion.chunk":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


# ---------------------------------------------------------------- stop strings


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_and_aborts(client, fake, model, stream):
    want = REPLY_TEXT[:REPLY_TEXT.index("STOP")]
    if stream:
        chunks = list(client.completions.create(model=model.name, prompt="x", max_tokens=100, stop=["STOP", "zzz"],
                                                stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        request_id, finish = chunks[0].id, chunks[-1].choices[0].finish_reason
    else:
        result = client.completions.create(model=model.name, prompt="x", max_tokens=100, stop="STOP")
        text, request_id, finish = result.choices[0].text, result.id, result.choices[0].finish_reason
    assert (text, finish) == (want, "stop")
    assert fake.wait_for(lambda f: request_id in f.aborted), "a stop string should abort the rest at the scheduler"


def test_chat_stop_string(client, model):
    result = client.chat.completions.create(model=model.name, messages=MESSAGES, stop=["東京"])
    assert result.choices[0].message.content == REPLY_TEXT[:REPLY_TEXT.index("東京")]
    assert result.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("path, payload, param, fragments", [
    ("/v1/completions", b'{"model": "x", "prompt": ', None, ["not valid JSON"]),
    ("/v1/chat/completions", b"not json at all", None, ["not valid JSON"]),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "hi"}, "model", ["`gpt-4o` does not exist"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", ["max_tokens must be at least 1, got 0"]),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens", ["max_tokens must be at least 1, got -1"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens", ["at least 1"]),
    ("/v1/completions", {"prompt": " ".join(["word"] * 200)}, "prompt",
     ["prompt has 200 tokens", f"limit is {MAX_MODEL_LEN}"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 200}]}, "messages",
     [f"limit is {MAX_MODEL_LEN}"]),
    ("/v1/completions", {"prompt": " ".join(["word"] * 100), "max_tokens": 50}, "max_tokens",
     ["100 prompt tokens + 50 max_tokens", f"maximum context length is {MAX_MODEL_LEN}"]),
    ("/v1/completions", {"prompt": "hi", "temperature": "warm"}, "temperature", ["must be a number, got string"]),
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n", ["n must be between 1 and 128, got 129"]),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", ["non-empty list"]),
])
def test_invalid_requests_get_a_400_and_the_server_carries_on(frontend, model, client, path, payload, param, fragments):
    if isinstance(payload, bytes):
        status, headers, raw = http("POST", frontend.base_url + path, data=payload)
    else:
        status, headers, raw = http("POST", frontend.base_url + path, body={"model": model.name} | payload)
    assert status == 400 and headers["Content-Type"].startswith("application/json")
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    again = client.completions.create(model=model.name, prompt="again", max_tokens=3)
    assert again.choices[0].finish_reason == "length"


def test_unknown_model_via_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_http_errors_have_openai_shape(frontend):
    status, _, raw = http("POST", frontend.base_url + "/v1/nowhere", body={})
    assert status == 404 and "Invalid URL (POST /v1/nowhere)" in json.loads(raw)["error"]["message"]
    status, headers, raw = http("GET", frontend.base_url + "/v1/completions")
    assert status == 405 and "POST" in headers["Allow"] and json.loads(raw)["error"]["code"] == "method_not_allowed"
    status, _, raw = http("POST", frontend.base_url + "/v1/completions", data=b"x" * (MAX_BODY_BYTES + 1))
    assert status == 413 and "too large" in json.loads(raw)["error"]["message"]
    status, _, raw = http("GET", frontend.base_url + "/v1/models/other")
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found"


def test_unexpected_exception_is_a_500_without_traceback():
    async def broken(request):
        raise RuntimeError("secret internals")

    async def go():
        app = web.Application(middlewares=[error_middleware])
        app.router.add_get("/broken", broken)
        async with TestClient(TestServer(app)) as http_client:
            resp = await http_client.get("/broken")
            return resp.status, await resp.text()

    with structlog.testing.capture_logs() as logs:
        status, text = asyncio.run(go())
    assert status == 500
    error = json.loads(text)["error"]
    assert error["type"] == "server_error" and "secret" not in text and "Traceback" not in text
    assert any(e["event"] == "unexpected error" and e["log_level"] == "error" for e in logs)


def test_engine_error_non_streamed(client, model):
    with pytest.raises(openai.InternalServerError) as info:  # the engine's fault: a 500, not a 400
        client.completions.create(model=model.name, prompt=f"please {ERROR_MARKER}")
    assert "simulated engine failure" in info.value.message


def test_engine_error_streamed(frontend, client, model):
    body = {"model": model.name, "messages": [{"role": "user", "content": ERROR_MARKER}], "stream": True}
    status, _, raw = http("POST", frontend.base_url + "/v1/chat/completions", body=body)
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "simulated engine failure" and error["type"] == "server_error"
    with pytest.raises(openai.APIError, match="simulated engine failure"):
        list(client.chat.completions.create(model=model.name, messages=body["messages"], stream=True))


def test_malformed_scheduler_frames_are_dropped(client, fake, model):
    fake.send_raw(b"\x93garbage")
    with pytest.raises(openai.InternalServerError, match="malformed"):  # fails the request instead of hanging
        client.completions.create(model=model.name, prompt=MALFORMED_MARKER)
    assert client.completions.create(model=model.name, prompt="ok", max_tokens=2).usage.completion_tokens == 2


# ---------------------------------------------------------------- disconnects and concurrency


def test_client_disconnect_mid_stream_aborts(frontend, fake, model):
    async def read_one_chunk_then_leave() -> str:
        async with aiohttp.ClientSession() as session:
            body = {"model": model.name, "prompt": SLOW_MARKER, "max_tokens": 100, "stream": True}
            async with session.post(frontend.base_url + "/v1/completions", json=body) as resp:
                line = await resp.content.readline()
                return json.loads(line[len(b"data: "):])["id"]

    request_id = asyncio.run(read_one_chunk_then_leave())
    assert fake.wait_for(lambda f: request_id in f.aborted), "disconnect should abort the request"


def test_client_timeout_on_non_streamed_request_aborts(frontend, fake, model):
    num_added = len(fake.added)

    async def give_up_once_sent() -> None:
        async with aiohttp.ClientSession() as session:
            body = {"model": model.name, "prompt": SLOW_MARKER, "max_tokens": 120}  # 2.4 s of tokens
            post = asyncio.create_task(session.post(frontend.base_url + "/v1/completions", json=body))
            deadline = time.monotonic() + 60
            while len(fake.added) == num_added:  # the request is at the scheduler...
                assert time.monotonic() < deadline, "the request never reached the scheduler"
                await asyncio.sleep(0.01)
            post.cancel()  # ... when the client gives up, as a client-side timeout does
            with pytest.raises(asyncio.CancelledError):
                await post

    asyncio.run(give_up_once_sent())
    request_id = fake.added[num_added].request_id
    assert fake.wait_for(lambda f: request_id in f.aborted), "a vanished client should abort the request"


def test_concurrent_requests_are_routed_by_id(frontend, model, fake):
    async def run_all():
        client = openai.AsyncOpenAI(base_url=frontend.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        async with client:
            jobs = [client.completions.create(model=model.name, prompt=f"n{i}", max_tokens=5 + i) for i in range(12)]
            return await asyncio.gather(*jobs)

    for i, result in enumerate(asyncio.run(run_all())):
        assert result.choices[0].text == expected(model, fake, 5 + i)[0]
        assert result.usage.completion_tokens == 5 + i


def test_request_id_is_bound_in_logs(client, model):
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        result = client.completions.create(model=model.name, prompt="log me", max_tokens=2)
    events = {e["event"] for e in logs if e.get("request_id") == result.id}
    assert {"request sent", "request finished"} <= events
