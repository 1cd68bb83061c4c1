"""One frontend in front of two data-parallel replicas (two fake schedulers on real ZMQ sockets):
routing by prompt prefix and by load, aborts to the replica that holds the request, /health and
/metrics over both, a replica lost (the other serves; /health says degraded), a replica that
restarts (counted, its requests handed back), and both lost (503)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from services.frontend.config import FrontendConfig
from services.frontend.replicas import sum_stats
from services.frontend.scheduler_history import COUNTERS
from shared.endpoints import Endpoints
from shared.messages import EngineStats
from tests.doubles.fake_scheduler import HOLD_MARKER, REPLY_TEXT, FakeScheduler, FrontendThread, cached_tokenizer, \
    default_served_model

HANG_GUARD_S = 30.0
SYSTEM = ("You are a careful assistant. Answer in one short sentence, cite no sources, and never use "
          "lists or tables; prefer plain words.")


def _get(url: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(url, timeout=HANG_GUARD_S) as resp:
            body = resp.read().decode()
            return resp.status, json.loads(body) if url.endswith("/health") else body
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())


def _until(predicate, what: str, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _start_replicas(tmp_path, **config):
    """Two fake schedulers and a frontend given both request endpoints, once /health says 200."""
    tokenizer = cached_tokenizer()
    eps = [Endpoints.in_directory(str(tmp_path), prefix=f"r{i}-") for i in range(2)]
    fakes = [FakeScheduler(e, tokenizer).start() for e in eps]
    endpoints = dataclasses.replace(eps[0], request=f"{eps[0].request},{eps[1].request}")
    front = FrontendThread(default_served_model(), endpoints, **config).start()
    _until(lambda: _get(front.base_url + "/health")[0] == 200, "both replicas healthy")
    return front, fakes, eps


def _stop(front, fakes) -> None:
    front.stop()
    for fake in fakes:
        if not fake._stop.is_set():
            fake.stop()


@pytest.fixture
def replicas(tmp_path):
    front, fakes, eps = _start_replicas(tmp_path)  # the default heartbeat timeout (10 s)
    yield front, fakes, eps
    _stop(front, fakes)


def _chat(url: str, user: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=HANG_GUARD_S)
    reply = client.chat.completions.create(model=default_served_model().name, max_tokens=200,
                                           messages=[{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": user}])
    return reply.choices[0].message.content


def _holders(fakes, needle: str) -> list[int]:
    """How many requests each fake was sent whose prompt contains ``needle``."""
    tokenizer = cached_tokenizer()
    return [sum(needle in tokenizer.decode(r.prompt_token_ids) for r in fake.added) for fake in fakes]


def test_requests_sharing_a_prefix_meet_at_one_replica_and_others_spread(replicas):
    front, fakes, _ = replicas
    for i in range(6):
        assert _chat(front.base_url, f"Question {i}: how far is the moon?") == REPLY_TEXT
    assert sorted(_holders(fakes, "careful assistant")) == [0, 6]
    client = openai.OpenAI(base_url=front.base_url + "/v1", api_key="x", max_retries=0, timeout=HANG_GUARD_S)
    for i in range(6):  # unrelated prompts, one at a time: the replicas take turns
        client.completions.create(model=default_served_model().name, prompt=f"{i} unrelated " * (i + 1), max_tokens=3)
    assert _holders(fakes, "unrelated") == [3, 3]
    status, metrics = _get(front.base_url + "/metrics")
    lines = metrics.splitlines()
    assert "pagedserve:data_parallel_size 2.0" in lines
    prefix_routed = [float(line.rsplit(" ", 1)[1]) for line in lines
                     if line.startswith("pagedserve:replica_routed_requests_total") and 'reason="prefix"' in line]
    assert sum(prefix_routed) == 5  # the first of the six went by turn, the five after it by their prefix
    status, health = _get(front.base_url + "/health")
    assert status == 200 and health["data_parallel_size"] == 2 and [r["replica"] for r in health["replicas"]] == [0, 1]
    assert all(r["status"] == "ok" and "frontend" not in r["processes"] for r in health["replicas"])


def test_an_abort_goes_to_the_replica_holding_the_request(replicas):
    front, fakes, _ = replicas
    url = front.base_url + "/v1/completions"

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD_S)) as session:
            held = [asyncio.create_task(session.post(url, json={"model": default_served_model().name,
                                                                "prompt": f"{HOLD_MARKER} {i}", "max_tokens": 5}))
                    for i in range(2)]
            await asyncio.to_thread(_until, lambda: sum(len(f.added) for f in fakes) == 2, "both requests sent")
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)

    asyncio.run(go())
    _until(lambda: sum(len(f.aborted) for f in fakes) == 2, "both aborts")
    for fake in fakes:  # one request each (turns), and each abort where its request is
        assert [r.request_id for r in fake.added] == fake.aborted


@pytest.mark.slow  # waits out a replica's silence
def test_a_silent_replica_takes_no_requests_before_it_counts_as_lost(replicas):
    front, fakes, _ = replicas
    fakes[1].stop()
    time.sleep(2.5)  # silent 2 s longer than the other: no more requests (lost only after 10 s)
    status, health = _get(front.base_url + "/health")
    assert status == 200 and "degraded" not in health
    before = len(fakes[0].added)
    for i in range(4):
        assert _chat(front.base_url, f"while one is silent {i}") == REPLY_TEXT
    assert len(fakes[0].added) == before + 4


@pytest.mark.slow  # waits out two replicas' silence
def test_a_lost_replica_leaves_the_other_serving_then_none(tmp_path):
    front, fakes, _ = _start_replicas(tmp_path, heartbeat_timeout=1.0)
    try:
        _lose_one_then_both(front, fakes)
    finally:
        _stop(front, fakes)


def _lose_one_then_both(front, fakes) -> None:
    fakes[1].stop()
    _until(lambda: "degraded" in _get(front.base_url + "/health")[1], "/health to say degraded")
    status, health = _get(front.base_url + "/health")
    assert status == 200 and health["status"] == "ok"
    assert health["degraded"].startswith("replica 1: the scheduler has not answered")
    before = len(fakes[0].added)
    for i in range(4):
        assert _chat(front.base_url, f"while one is gone {i}") == REPLY_TEXT
    assert len(fakes[0].added) == before + 4
    fakes[0].stop()
    _until(lambda: _get(front.base_url + "/health")[0] == 503, "/health 503")
    status, health = _get(front.base_url + "/health")
    assert "replica 0" in health["reason"] and "replica 1" in health["reason"]
    with pytest.raises(openai.InternalServerError, match="engine_unavailable|unavailable"):
        _chat(front.base_url, "nobody home")


def test_an_engine_client_s_counters_and_readiness_outlive_its_schedulers():
    from services.frontend.engine_client import EngineClient

    client = EngineClient(Endpoints("ipc:///nowhere.sock", "", ""))
    try:
        client._on_stats(EngineStats(0, 0, 10, 0, 0, 0, False, num_prefix_cache_hits=4, epoch=1))
        assert not client.ever_ready and client.counters()["num_prefix_cache_hits"] == 4
        client._on_stats(EngineStats(0, 0, 10, 0, 0, 0, True, num_prefix_cache_hits=9, num_steps=3, epoch=1))
        client._on_stats(EngineStats(0, 0, 10, 0, 0, 0, False, num_prefix_cache_hits=2, num_steps=1, epoch=2))
        counters = client.counters()
        assert client.ever_ready and client.num_scheduler_restarts == 1
        assert counters["num_prefix_cache_hits"] == 11 and counters["num_steps"] == 4
    finally:
        asyncio.run(client.close())


def test_a_restarted_replica_is_counted_and_gets_its_requests_back(replicas):
    front, fakes, eps = replicas
    url = front.base_url + "/v1/completions"
    body = {"model": default_served_model().name, "prompt": f"{HOLD_MARKER} at replica 0", "max_tokens": 5}

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD_S)) as session:
            task = asyncio.create_task(session.post(url, json=body))
            await asyncio.to_thread(_until, lambda: len(fakes[0].added) == 1, "the held request at replica 0")
            fakes[0].stop()
            fakes[0] = FakeScheduler(eps[0], cached_tokenizer(), epoch=7).start()  # the same socket, a new scheduler
            await asyncio.to_thread(_until, lambda: len(fakes[0].added) == 1, "the request handed to the new one")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    assert fakes[0].added[0].prompt_token_ids.tolist() == cached_tokenizer().encode(body["prompt"])
    _until(lambda: _get(front.base_url + "/health")[1]["replicas"][0]["processes"]["scheduler"]["num_restarts"] == 1,
           "replica 0's restart in /health")
    assert 'pagedserve:process_restarts_total{process="scheduler"} 1.0' in _get(front.base_url + "/metrics")[1]


def test_a_replica_still_starting_keeps_health_at_503(tmp_path):
    tokenizer = cached_tokenizer()
    eps = [Endpoints.in_directory(str(tmp_path), prefix=f"r{i}-") for i in range(2)]
    fakes = [FakeScheduler(eps[0], tokenizer).start(), FakeScheduler(eps[1], tokenizer, ready=False).start()]
    endpoints = dataclasses.replace(eps[0], request=f"{eps[0].request},{eps[1].request}")
    front = FrontendThread(default_served_model(), endpoints).start()
    try:
        _until(lambda: "replicas" in _get(front.base_url + "/health")[1]
               and all("pid" in r.get("processes", {}).get("scheduler", {})
                       for r in _get(front.base_url + "/health")[1]["replicas"]), "stats from both")
        status, health = _get(front.base_url + "/health")
        assert status == 503 and health["reason"] == "replica 1: the scheduler is not ready"
        assert _chat(front.base_url, "served by the ready one meanwhile") == REPLY_TEXT
        assert len(fakes[0].added) == 1 and not fakes[1].added
        fakes[1].ready = True
        _until(lambda: _get(front.base_url + "/health")[0] == 200, "/health 200 once both are ready")
    finally:
        front.stop()
        for fake in fakes:
            fake.stop()


def test_summed_stats_and_the_endpoint_list():
    a = EngineStats(2, 1, 100, 10, 5, 8, True, num_prefix_cache_hits=16, epoch=1, pid=11, world_size=2)
    b = EngineStats(3, 0, 100, 20, 6, 9, False, num_prefix_cache_hits=32, epoch=2, pid=12, world_size=2)
    total = sum_stats([a, b])
    assert (total.num_running, total.num_waiting, total.num_blocks_total, total.num_blocks_used) == (5, 1, 200, 30)
    assert total.num_prefix_cache_hits == 48 and total.ready and total.world_size == 2 and total.pid == 11
    assert sum_stats([]) is None
    # the group's shape from a ready replica (a restarting scheduler's stats have none yet)
    bare = EngineStats(0, 0, 0, 0, 0, 0, False, epoch=3, pid=13)
    assert sum_stats([bare, a]).pid == 11 and sum_stats([bare, a]).world_size == 2
    # counters over each replica's every scheduler, when given
    counters = [dict.fromkeys(COUNTERS, 1), dict.fromkeys(COUNTERS, 100)]
    assert sum_stats([a, b], counters).num_prefix_cache_hits == 101
    config = FrontendConfig(endpoints=Endpoints("ipc:///a.sock, tcp://h:5", "", ""))
    assert config.request_endpoints == ["ipc:///a.sock", "tcp://h:5"]
    with pytest.raises(ValueError, match="must start with"):
        FrontendConfig(endpoints=Endpoints("ipc:///a.sock,h:5", "", ""))
    with pytest.raises(ValueError, match="twice"):
        FrontendConfig(endpoints=Endpoints("ipc:///a.sock,ipc:///a.sock", "", ""))
