"""Clients that misbehave slowly cannot hold the frontend: header, body, idle and write deadlines,
and the connection cap (real frontend on short limits, fake scheduler, raw sockets).

The limits here are 1-2 s; each test asserts what the server did (a 408, a close, an abort at the
scheduler) and bounds the wait only to guard against hangs, several times the limit.
"""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from services.frontend.flags import HttpLimits
from shared.endpoints import Endpoints
from tests.doubles.fake_scheduler import SLOW_MARKER, FakeScheduler, FrontendThread, cached_tokenizer
from tests.doubles.http import http, sse_events

MAX_MODEL_LEN = 65536  # room for the long echoed prompt of the write test
LIMITS = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.0, keepalive_timeout_s=2.0, write_timeout_s=1.0)
HANG_GUARD_S = 20.0  # far above every limit: only a server that never acts takes this long


@pytest.fixture(scope="module")
def limited(model, fake):
    server = FrontendThread(model, fake.endpoints, http_limits=LIMITS).start()
    yield server
    server.stop()


def connect(server: FrontendThread, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", server.server.port))
    return sock


def read_until_closed(sock: socket.socket, timeout: float = HANG_GUARD_S, trickle: bytes = b"") -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took; sends
    ``trickle`` every 0.25 s meanwhile. Fails if the connection is still open after ``timeout``."""
    started = time.monotonic()
    received = b""
    next_send = started
    while time.monotonic() - started < timeout:
        if trickle and time.monotonic() >= next_send:
            try:
                sock.sendall(trickle)
            except OSError:
                pass  # closed by the server: the read below sees it
            next_send += 0.25
        ready, _, _ = select.select([sock], [], [], 0.05)
        if not ready:
            continue
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            return received, time.monotonic() - started
        if not chunk:
            return received, time.monotonic() - started
        received += chunk
    pytest.fail(f"the connection was still open after {timeout} s; got {received[:200]!r}")


def test_slow_headers_get_408_and_are_closed(limited):
    sock = connect(limited)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    received, elapsed = read_until_closed(sock, trickle=b"a")  # one header byte every 0.25 s
    assert received.startswith(b"HTTP/1.1 408 ")
    assert "--http-header-timeout-s" in json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]["message"]
    assert elapsed >= LIMITS.header_timeout_s
    assert limited.server.guard.num_closed["header"] >= 1


@pytest.mark.slow  # waits out the idle deadline
def test_idle_connections_are_closed(limited):
    silent = connect(limited)  # never sends a byte
    used = connect(limited)  # one request, then idle on keep-alive
    used.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    answer, elapsed = read_until_closed(used)
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"object":"list"' in answer.replace(b" ", b"")
    assert elapsed >= LIMITS.keepalive_timeout_s
    nothing, _ = read_until_closed(silent)
    assert nothing == b""
    assert limited.server.guard.num_closed["idle"] >= 2


@pytest.mark.slow  # waits out a read deadline
def test_slow_body_gets_408(limited):
    sock = connect(limited)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    received, elapsed = read_until_closed(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "--http-body-timeout-s" in error["message"]
    assert elapsed >= LIMITS.body_timeout_s


@pytest.mark.slow  # waits out a read deadline
def test_the_rest_of_an_unread_body_is_not_a_new_request(limited):
    """A handler that answers without reading the body (a 404 here): the body's later bytes are not
    a next request's headers, so no 408 follows the 404; the idle deadline ends the connection."""
    sock = connect(limited)
    sock.sendall(b"POST /nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
    received, _ = read_until_closed(sock, trickle=b" ")
    assert received.startswith(b"HTTP/1.1 404 ") and received.count(b"HTTP/1.1 ") == 1, received


@pytest.mark.slow  # streams past every deadline
def test_a_long_stream_outlives_every_deadline(limited, model):
    """A reading client is never cut: 120 tokens at 20 ms each take longer than every limit."""
    status, _, raw = http("POST", limited.base_url + "/v1/completions", body={
        "prompt": f"{SLOW_MARKER} go", "max_tokens": 120, "stream": True, "stream_options": {"include_usage": True},
    })
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 120


def test_a_client_that_never_reads_is_dropped_and_its_request_aborted(limited, fake, model):
    tokenizer = model.tokenizer
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    longest_id = max(range(len(tokens)), key=lambda i: len(tokens[i]) if tokens[i] else 0)
    prompt = list(tokenizer.encode(SLOW_MARKER)) + [longest_id] * 40_000  # echoed: megabytes of text
    body = json.dumps({"prompt": prompt, "echo": True, "stream": True, "max_tokens": 1000}).encode()
    sock = connect(limited, rcvbuf=4096)
    num_added = len(fake.added)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert fake.wait_for(lambda f: len(f.added) > num_added, timeout=HANG_GUARD_S)
    request_id = fake.added[-1].request_id
    assert len(fake.added[-1].prompt_token_ids) == len(prompt)
    # Never read: the echo fills every buffer, writing stalls, the guard cuts the connection.
    assert fake.wait_for(lambda f: request_id in f.aborted, timeout=HANG_GUARD_S)
    assert limited.server.guard.num_closed["write"] >= 1
    received, _ = read_until_closed(sock)
    assert b"[DONE]" not in received


@pytest.fixture
def capped(model, tmp_path):
    fake = FakeScheduler(Endpoints.in_directory(str(tmp_path)), cached_tokenizer()).start()
    server = FrontendThread(model, fake.endpoints, http_limits=HttpLimits(max_connections=3)).start()
    yield server
    server.stop()
    fake.stop()


def test_connections_beyond_the_cap_get_503(capped):
    held = [connect(capped) for _ in range(3)]
    refused = connect(capped)
    received, _ = read_until_closed(refused)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in head
    assert "--http-max-connections" in json.loads(body)["error"]["message"]
    assert capped.server.guard.num_refused >= 1
    held.pop().close()
    deadline = time.monotonic() + HANG_GUARD_S
    while capped.server.guard.num_connections >= 3:  # the server sees the close
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, _, _ = http("GET", capped.base_url + "/v1/models")
    assert status == 200
    for sock in held:
        sock.close()


@pytest.mark.parametrize("field, value, flag", [
    ("header_timeout_s", 0, "--http-header-timeout-s"),
    ("write_timeout_s", float("inf"), "--http-write-timeout-s"),
    ("keepalive_timeout_s", -1.0, "--http-keepalive-timeout-s"),
    ("max_connections", 0, "--http-max-connections"),
    ("max_connections", 2.5, "--http-max-connections"),
])
def test_bad_limits_name_their_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        HttpLimits(**{field: value})
