"""The playground's routes on the real frontend against the fake scheduler: the page and its files,
the API key, ``--no-playground``, and ``/v1/kv/events``: it watches the scheduler only while a
client is connected, and a client that does not read gets fewer snapshots, never a queue."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from services.frontend.playground import KV_HUB, STATIC_TYPES
from services.launcher import frontend_argv
from shared.messages import EngineStats, KvSnapshot, encode
from tests.doubles.fake_scheduler import FrontendThread

API_KEY = "sk-playground-test"
RENEW_S = 0.3  # this frontend's watch renewal period (the product's is 1 s): the waits below are two of it


def _get(url: str, key: str | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=20) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _snapshot(snapshot_id: int, num_seqs: int = 3, blocks_per_seq: int = 3) -> KvSnapshot:
    """``num_seqs`` samples of one request: blocks 0 and 1 shared, the rest each its own."""
    tables = [[0, 1, 2 + i, *range(100 + 16 * i, 97 + 16 * i + blocks_per_seq)] for i in range(num_seqs)]
    used = sorted({b for t in tables for b in t})
    counts = [sum(t.count(b) for t in tables) for b in used]
    return KvSnapshot(
        snapshot_id=snapshot_id, block_size=16, num_blocks=100_000, num_cpu_blocks=4,
        used_block_ids=np.array(used, np.int32), used_ref_counts=np.array(counts, np.int32),
        cached_block_ids=np.array([0, 1], np.int32), cpu_used_block_ids=np.zeros(0, np.int32),
        cpu_used_ref_counts=np.zeros(0, np.int32), seq_ids=np.arange(num_seqs, dtype=np.int64),
        request_ids=[f"chatcmpl-{'a' * 32}"] * num_seqs, choice_idxs=np.arange(num_seqs, dtype=np.int32),
        on_cpu=np.zeros(num_seqs, bool), num_computed_tokens=np.full(num_seqs, 40, np.int32),
        table_starts=np.array([0] + list(np.cumsum([len(t) for t in tables])), np.int32),
        table_block_ids=np.array([b for t in tables for b in t], np.int32), events=np.zeros((0, 3), np.int32),
        num_events_dropped=0, stats=EngineStats(num_seqs, 0, 100_000, len(used), 120, 144, True),
    )


def _metric(url: str, name: str) -> float:
    text = _get(url + "/metrics", API_KEY)[2].decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"pagedserve:{name} ")))


def _wait(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


class _EventStream:
    """A reading client of /v1/kv/events: ``next()`` is the next event's parsed data."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        self.conn.request("GET", "/v1/kv/events", headers={"Authorization": f"Bearer {API_KEY}"})
        self.response = self.conn.getresponse()

    def next(self) -> dict:
        while True:
            line = self.response.readline()
            assert line, "the stream ended"
            if line.startswith(b"data: "):
                return json.loads(line[len(b"data: "):])

    def close(self) -> None:
        self.conn.close()


@pytest.fixture(scope="module")
def server(model, fake):
    frontend = FrontendThread(model, fake.endpoints, api_key=API_KEY).start()
    frontend.server.app[KV_HUB].renew_s = RENEW_S
    yield frontend
    frontend.stop()


def test_page_and_files_are_served_without_a_key_and_the_events_need_one(server):
    url = server.base_url
    status, headers, body = _get(url + "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'<script src="/static/kvmap.js">' in body and "default-src 'self'" in headers["Content-Security-Policy"]
    for name, content_type in STATIC_TYPES.items():
        status, headers, body = _get(f"{url}/static/{name}")
        assert status == 200 and headers["Content-Type"] == content_type and body
        assert b"http://" not in body and b"https://" not in body  # nothing from elsewhere (no CDN, no fonts)
    assert _get(url + "/static/replay.js")[0] == 404  # only the page's own files
    status, _, body = _get(url + "/v1/kv/events")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    spec = json.loads(_get(url + "/openapi.json", API_KEY)[2])
    events = spec["paths"]["/v1/kv/events"]["get"]["responses"]["200"]["content"]["text/event-stream"]
    assert events["itemSchema"]["properties"]["data"]["contentSchema"] == {"$ref": "#/components/schemas/KvSnapshot"}
    assert {"blocks", "sequences", "events", "stats"} <= set(spec["components"]["schemas"]["KvSnapshot"]["properties"])
    assert spec["paths"]["/"]["get"]["security"] == []


def test_events_watch_the_scheduler_only_while_a_client_is_connected(server, fake):
    num_before = len(fake.kv_watches)
    time.sleep(2 * RENEW_S)  # longer than the renewal period: nobody watching means nothing is sent
    assert len(fake.kv_watches) == num_before and fake.kv_watches[-1:] in ([], [False])
    stream = _EventStream(server.server.port)
    try:
        assert fake.wait_for(lambda f: f.kv_watches[num_before:] == [True])
        fake.send_raw(encode(_snapshot(7)))
        data = stream.next()
        assert data["snapshot_id"] == 7 and data["blocks"]["num_blocks"] == 100_000
        assert data["blocks"]["used_block_ids"] == [0, 1, 2, 3, 4] and data["blocks"]["ref_counts"] == [3, 3, 1, 1, 1]
        assert [s["block_table"] for s in data["sequences"]] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
        assert fake.wait_for(lambda f: f.kv_watches[num_before:].count(True) >= 2, timeout=5)  # renewed
        assert _metric(server.base_url, "kv_events_clients") == 1
    finally:
        stream.close()
    assert fake.wait_for(lambda f: f.kv_watches[-1] is False)
    assert _wait(lambda: _metric(server.base_url, "kv_events_clients") == 0)
    num_after = len(fake.kv_watches)
    time.sleep(2 * RENEW_S)
    assert len(fake.kv_watches) == num_after  # no renewal once the last client left


@pytest.mark.slow  # fills a socket's buffers
def test_a_client_that_never_reads_gets_updates_dropped_not_queued(server, fake, model):
    dropped_before = _metric(server.base_url, "kv_events_dropped_total")
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", server.server.port))
    slow.sendall(f"GET /v1/kv/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n\r\n".encode())
    reader = None
    try:
        assert fake.wait_for(lambda f: f.kv_watches and f.kv_watches[-1] is True)
        reader = _EventStream(server.server.port)
        big = [encode(_snapshot(i, num_seqs=1000, blocks_per_seq=16)) for i in range(1, 4)]  # ~370 KB of JSON
        for i in range(40):  # 15 MB for a client whose socket buffers hold tens of KB
            fake.send_raw(big[i % 3])
        assert _wait(lambda: _metric(server.base_url, "kv_events_dropped_total") - dropped_before >= 20, 60)
        # The frontend is not held up by it: the reading client and a generation go on.
        fake.send_raw(encode(_snapshot(99)))
        assert _wait_for_snapshot(reader, 99)
        from openai import OpenAI

        client = OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=20)
        reply = client.completions.create(model=model.name, prompt="hi", max_tokens=4)
        assert reply.usage.completion_tokens == 4
    finally:
        slow.close()
        if reader is not None:
            reader.close()


def _wait_for_snapshot(stream: _EventStream, snapshot_id: int) -> bool:
    for _ in range(300):
        if stream.next()["snapshot_id"] == snapshot_id:
            return True
    return False


def test_no_playground_turns_the_page_and_the_events_off(model, fake):
    frontend = FrontendThread(model, fake.endpoints, playground=False).start()
    try:
        for path in ("/", "/static/app.js", "/v1/kv/events"):
            status, _, body = _get(frontend.base_url + path)
            assert status == 404 and json.loads(body)["error"]["code"] == "not_found", path
        spec = json.loads(_get(frontend.base_url + "/openapi.json")[2])
        assert "/v1/kv/events" not in spec["paths"] and "KvSnapshot" not in spec["components"]["schemas"]
    finally:
        frontend.stop()


def test_serve_passes_no_playground_to_the_frontend():
    from services.cli import build_parser

    on = build_parser().parse_args(["serve"])
    off = build_parser().parse_args(["serve", "--no-playground"])
    assert "--no-playground" not in frontend_argv(on) and "--no-playground" in frontend_argv(off)
