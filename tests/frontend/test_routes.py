"""The routes around generation, and the limits: tokenize, detokenize, version, openapi.json,
/metrics, the API key, the queue limit (fake scheduler)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from shared.restart_counts import write_restart_counts
from tests.doubles.fake_scheduler import HOLD_MARKER, FrontendThread
from tests.doubles.http import http, wait_for_health

MAX_MODEL_LEN = 128
API_KEY = "sk-test-7f3a"
HANG_GUARD_S = 60  # client timeouts: long enough for a loaded machine, short of pytest's own


def post(frontend, path: str, body: object) -> tuple[int, dict]:
    status, _, raw = http("POST", frontend.base_url + path, body=body)
    return status, json.loads(raw)


def test_tokenize_and_detokenize(frontend, model):
    status, body = post(frontend, "/tokenize", {"prompt": "Hello 東京"})
    ids = model.tokenizer.encode("Hello 東京")
    assert status == 200 and body == {"tokens": ids, "count": len(ids), "max_model_len": MAX_MODEL_LEN}
    messages = [{"role": "user", "content": "hi"}]
    status, body = post(frontend, "/tokenize", {"messages": messages, "model": model.name})
    want = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert status == 200 and body["tokens"] == list(want)
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]
    status, body = post(frontend, "/tokenize", {"messages": messages, "tools": tools})
    want = model.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    assert status == 200 and body["tokens"] == list(want)  # as chat passes them to the template
    status, body = post(frontend, "/detokenize", {"tokens": ids})
    assert status == 200 and body == {"prompt": "Hello 東京"}
    for path, payload, param in [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": messages, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [model.vocab_size]}, "tokens"),
    ]:
        status, body = post(frontend, path, payload)
        assert status == 400 and body["error"]["param"] == param, (path, payload, body)


def test_version_and_openapi(frontend):
    status, _, raw = http("GET", frontend.base_url + "/version")
    assert status == 200 and json.loads(raw)["version"]
    status, _, raw = http("GET", frontend.base_url + "/openapi.json")
    spec = json.loads(raw)
    assert status == 200 and spec["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/metrics", "/health",
            "/version", "/v1/models"} <= set(spec["paths"])
    completion = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"logit_bias", "logprobs", "echo", "min_p", "repetition_penalty", "stop_token_ids"} <= set(completion)
    refs = [v for v in _walk(spec) if isinstance(v, str) and v.startswith("#/components/schemas/")]
    assert refs and all(r.rsplit("/", 1)[1] in spec["components"]["schemas"] for r in refs)


def _walk(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v)
    else:
        yield value


def metric_values(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_metrics(frontend, model):
    status, headers, raw = http("GET", frontend.base_url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    before = metric_values(raw.decode())
    for name in ["num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
                 "kv_slot_utilization", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_count"]:
        assert f"pagedserve:{name}" in before, name
    client = openai.OpenAI(base_url=frontend.base_url + "/v1", api_key="x", max_retries=0, timeout=HANG_GUARD_S)
    result = client.completions.create(model=model.name, prompt="count me", max_tokens=6)
    list(client.completions.create(model=model.name, prompt="and me", max_tokens=4, stream=True))
    after = metric_values(http("GET", frontend.base_url + "/metrics")[2].decode())
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["pagedserve:generation_tokens_total"] == 10
    assert delta["pagedserve:prompt_tokens_total"] == result.usage.prompt_tokens + len(model.tokenizer.encode("and me"))
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert delta[f"pagedserve:{name}_count"] == 2, name
    assert delta['pagedserve:request_success_total{finished_reason="length"}'] == 2


def test_metrics_and_health_count_restarts_from_the_launchers_file(model, fake, tmp_path):
    """Under ``pagedserve serve`` /metrics and /health show the launcher's restart counts, read at
    each request."""
    path = str(tmp_path / "restarts.json")
    server = FrontendThread(model, fake.endpoints, restarts_file=path).start()

    def restarts() -> dict[str, float]:
        values = metric_values(http("GET", server.base_url + "/metrics")[2].decode())
        return {p: values[f'pagedserve:process_restarts_total{{process="{p}"}}'] for p in ("executor", "scheduler",
                                                                                            "frontend")}

    def scheduler_restarts_in_health() -> int:
        return wait_for_health(server.base_url, 200)["processes"]["scheduler"]["num_restarts"]

    try:
        assert restarts() == {"executor": 0, "scheduler": 0, "frontend": 0}  # no file yet: what the fake reports
        assert scheduler_restarts_in_health() == 0
        write_restart_counts(path, {"executor": 3, "scheduler": 1, "frontend": 2})
        assert restarts() == {"executor": 3, "scheduler": 1, "frontend": 2}
        assert scheduler_restarts_in_health() == 1
        write_restart_counts(path, {"executor": 4, "scheduler": 2, "frontend": 2})
        assert restarts()["executor"] == 4 and scheduler_restarts_in_health() == 2
    finally:
        server.stop()


def test_api_key(model, fake):
    server = FrontendThread(model, fake.endpoints, api_key=API_KEY).start()
    try:
        url = server.base_url
        assert http("GET", url + "/health")[0] in (200, 503)  # open, whatever the engine says
        for path in ("/v1/models", "/metrics", "/version", "/openapi.json"):
            status, headers, raw = http("GET", url + path)
            error = json.loads(raw)["error"]
            assert status == 401 and error["code"] == "invalid_api_key" and headers["WWW-Authenticate"] == "Bearer"
            assert "no API key" in error["message"]
        with pytest.raises(openai.AuthenticationError, match="not valid"):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=HANG_GUARD_S).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=HANG_GUARD_S)
        assert good.completions.create(model=model.name, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert "securitySchemes" in json.dumps(good.get("/../openapi.json", cast_to=object))
    finally:
        server.stop()


def test_full_queue_gets_503_with_retry_after(model, fake):
    server = FrontendThread(model, fake.endpoints, max_queue_len=2).start()
    try:
        url = server.base_url + "/v1/completions"
        held = {"model": model.name, "prompt": HOLD_MARKER, "max_tokens": 5}

        async def until(predicate) -> None:
            """Wait for the fake scheduler to have seen something (a deadline only against a hang)."""
            deadline = asyncio.get_running_loop().time() + HANG_GUARD_S
            while not predicate(fake):
                assert asyncio.get_running_loop().time() < deadline, "the fake scheduler never saw it"
                await asyncio.sleep(0.01)

        async def go():
            timeout = aiohttp.ClientTimeout(total=HANG_GUARD_S)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                num_added = len(fake.added)
                waiting = [asyncio.create_task(session.post(url, json=held)) for _ in range(2)]
                await until(lambda f: len(f.added) >= num_added + 2)  # both at the scheduler, no output yet
                held_ids = [r.request_id for r in fake.added[num_added:num_added + 2]]
                async with session.post(url, json=held | {"prompt": "x"}) as resp:
                    full = resp.status, resp.headers.get("Retry-After"), await resp.json()
                async with session.post(url, json=held | {"prompt": ["a", "b", "c"]}) as resp:
                    never = resp.status, await resp.json()
                for task in waiting:  # the clients give up: their requests leave the queue
                    task.cancel()
                await asyncio.gather(*waiting, return_exceptions=True)
                # The frontend sends a request's abort and frees its queue place in one call on its loop.
                await until(lambda f: set(held_ids) <= set(f.aborted))
                async with session.post(url, json=held | {"prompt": "x"}) as resp:
                    return full, never, resp.status

        (status, retry_after, body), (never_status, never), later = asyncio.run(go())
        assert status == 503 and retry_after == "1"
        error = body["error"]
        assert error["code"] == "queue_full" and "2 requests are waiting" in error["message"]
        assert "--max-queue-len" in error["message"]
        assert never_status == 400 and never["error"]["param"] == "prompt" and "3 prompts" in never["error"]["message"]
        assert later == 200
    finally:
        server.stop()
