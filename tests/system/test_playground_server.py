"""/v1/kv/events on the whole server (``pagedserve serve`` on a tiny random model): the scheduler
builds no snapshot while no client is connected, and a client that never reads does not slow
the engine (its updates are dropped, counted)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import time
import urllib.parse
import urllib.request

import pytest

from tests.doubles.serve import tiny_server

pytestmark = pytest.mark.slow

# Many sequences at once (8 requests of n = 16), so that each snapshot lists 128 block tables (about
# 15 KB of JSON) and a client that reads nothing fills its small socket buffers within seconds.
BATCH = 8
N = 16
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    yield from tiny_server(tmp_path_factory, "playground-serve", "--num-kv-blocks", "4096", "--max-num-seqs",
                           str(BATCH * N), model_dir=tiny_model_dir)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=20) as resp:
        text = resp.read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"pagedserve:{name} ")))


def _wait(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def _batch(url: str, model: str) -> float:
    """Seconds for ``BATCH`` concurrent completions of ``N`` choices of ``MAX_TOKENS`` tokens each."""
    body = json.dumps({"model": model, "prompt": "The block pool", "max_tokens": MAX_TOKENS, "n": N,
                       "temperature": 1.0, "ignore_eos": True}).encode()

    def one(_):
        request = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            return json.loads(resp.read())["usage"]["completion_tokens"]

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(BATCH) as pool:
        assert list(pool.map(one, range(BATCH))) == [N * MAX_TOKENS] * BATCH
    return time.monotonic() - started


def _model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=20) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _stable_snapshot_count(url: str) -> float:
    """The scheduler's count once its latest stats have reached the frontend (sent every 0.5 s)."""
    time.sleep(1.2)
    return _metric(url, "kv_snapshots_total")


def test_no_client_no_snapshot_and_a_client_that_never_reads_does_not_slow_the_engine(server):
    url = server
    model = _model(url)
    _batch(url, model)  # warm-up: the kernels compile on first use
    base_s = _batch(url, model)
    assert _stable_snapshot_count(url) == 0  # nobody watched: the scheduler built nothing
    assert _metric(url, "kv_events_clients") == 0

    host, port = urllib.parse.urlsplit(url).hostname, urllib.parse.urlsplit(url).port
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect((host, port))
    slow.sendall(b"GET /v1/kv/events HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read a byte
    try:
        assert _wait(lambda: _metric(url, "kv_snapshots_total") > 0)
        slow_s = _batch(url, model)
        for _ in range(3):  # keep the pool changing until the client's buffers are full
            if _wait(lambda: _metric(url, "kv_events_dropped_total") > 0, 3):
                break
            _batch(url, model)
        assert _metric(url, "kv_events_dropped_total") > 0  # dropped for it, not queued
        print(f"batch of {BATCH} x {N} x {MAX_TOKENS} tokens: {base_s:.2f} s alone, {slow_s:.2f} s with a client "
              f"that never reads ({_metric(url, 'kv_events_dropped_total'):.0f} snapshots dropped for it)")
        assert slow_s < 3 * base_s + 2.0  # generous: the machine is shared; a blocked engine would never finish
        assert _metric(url, "kv_events_clients") == 1
    finally:
        slow.close()

    assert _wait(lambda: _metric(url, "kv_events_clients") == 0)
    built = _stable_snapshot_count(url)
    _batch(url, model)
    assert _stable_snapshot_count(url) == built  # the watch ended with the last client


def test_a_reading_client_sees_the_requests_blocks_and_their_release(server):
    url = server
    model = _model(url)
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", "/v1/kv/events")
    stream = conn.getresponse()
    seen: list[dict] = []

    def read_until(predicate) -> dict:
        while True:
            line = stream.readline()
            assert line, "the stream ended"
            if line.startswith(b"data: "):
                seen.append(json.loads(line[len(b"data: "):]))
                if predicate(seen[-1]):
                    return seen[-1]

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            body = json.dumps({"model": model, "prompt": "x " * 40, "max_tokens": 200, "n": 3, "temperature": 1.0,
                               "ignore_eos": True}).encode()
            request = urllib.request.Request(url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            answer = pool.submit(lambda: json.loads(urllib.request.urlopen(request, timeout=120).read()))
            busy = read_until(lambda s: sum(q["request_id"].startswith("cmpl-") for q in s["sequences"]) == 3)
            reply = answer.result()
        mine = [q for q in busy["sequences"] if q["request_id"] == reply["id"]]
        assert sorted(q["choice"] for q in mine) == [0, 1, 2]
        num_full = reply["usage"]["prompt_tokens"] // 16
        assert num_full >= 2
        prompt_blocks = mine[0]["block_table"][:num_full]
        counts = dict(zip(busy["blocks"]["used_block_ids"], busy["blocks"]["ref_counts"]))
        assert all(counts[b] == 3 for b in prompt_blocks)  # shared by the three samples
        done = read_until(lambda s: not s["sequences"])
        assert done["stats"]["num_blocks_used"] == 0
        assert done["blocks"]["used_block_ids"] == []
        assert set(prompt_blocks) <= set(done["blocks"]["cached_block_ids"])  # kept for the prefix cache
    finally:
        conn.close()
