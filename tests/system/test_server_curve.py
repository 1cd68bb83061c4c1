"""``pagedserve serve --zmq-curve`` on a tiny random Llama: the three processes talk over CURVE with
throw-away keys, a completion is served, and clients without an allowed key (a stranger's CURVE
keys, plain ZeroMQ) are refused by the scheduler: their well-formed requests never reach it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import zmq

from shared.endpoints import Endpoints
from shared.messages import AddRequest, SamplingParams, encode
from shared.zmq_auth import CurveKeys
from tests.doubles.serve import start_server, stop
from tests.shared.test_zmq_auth import _connect, _handshake

pytestmark = pytest.mark.slow

MODEL = "tiny"


@pytest.fixture(scope="module")
def curve_server(tmp_path_factory, tiny_model_dir):
    """(URL, the request endpoint, the scheduler's public key, the server's log file)."""
    root = tmp_path_factory.mktemp("serve-curve")
    proc, url = start_server(root, "--zmq-curve", "--model", str(tiny_model_dir), "--served-model-name", MODEL,
                       "--dtype", "float32", "--kv-cache-memory", "16MiB")
    [socket_dir] = [p for p in root.iterdir() if p.name.startswith("pagedserve-")]
    server_key = zmq.auth.load_certificate(str(socket_dir / "zmq-curve" / "public" / "scheduler.key"))[0]
    yield url, Endpoints.in_directory(str(socket_dir)).request, server_key, root / "serve.log"
    stop(proc)


def _complete(url: str, prompt: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    return reply.choices[0].text


def _rogue_request(request_id: str) -> bytes:
    params = SamplingParams(max_tokens=4, eos_token_ids=[0])
    return encode(AddRequest(request_id, np.array([1, 2, 3], np.int32), params, 0.0))


def _offer(socket: zmq.Socket, frame: bytes) -> None:
    """Queue ``frame`` where the socket still has a pipe to the scheduler. A refused handshake may
    already have closed it (a busy machine lets it happen first), and a DEALER without a pipe
    blocks its sender: then there is nothing to send over, which is what the test shows too."""
    try:
        socket.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass


def test_serves_over_curve_and_refuses_strangers(curve_server):
    url, request_endpoint, server_key, log_path = curve_server
    first = _complete(url, "The capital of France is")
    ctx = zmq.Context()
    try:
        public, secret = zmq.curve_keypair()
        stranger, stranger_monitor = _connect(ctx, zmq.DEALER, request_endpoint,
                                              CurveKeys("frontend", "", public, secret, server_key), b"rogue-curve")
        _offer(stranger, _rogue_request("rogue-curve-request"))
        assert _handshake(stranger_monitor) == zmq.Event.HANDSHAKE_FAILED_AUTH
        plain, plain_monitor = _connect(ctx, zmq.DEALER, request_endpoint, None, b"rogue-plain")
        _offer(plain, _rogue_request("rogue-plain-request"))
        assert _handshake(plain_monitor) != zmq.Event.HANDSHAKE_SUCCEEDED
        assert _complete(url, "The capital of France is") == first  # the real frontend still gets through
        assert not stranger.poll(0) and not plain.poll(0)  # no output, no stats: nothing came back
    finally:
        ctx.destroy(linger=0)
    log = log_path.read_text()
    for never_seen in ("rogue-curve", "rogue-plain"):  # neither the frontend nor its request got in
        assert never_seen not in log
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    refused = [e for e in events if e["event"] == "zmq client refused: unknown CURVE key"]
    assert {(e["process"], e["domain"], e["client_key"]) for e in refused} == {
        ("scheduler", "frontend", public.decode())}  # the plain client never got as far as showing a key
    modes = {e["process"]: e["mode"] for e in events if e["event"] == "zmq security"}
    assert modes == {"launcher": "curve", "scheduler": "curve", "frontend": "curve", "executor": "curve"}
    assert sum(e["event"] == "request added" for e in events) == 2  # the two real completions
    assert not [e for e in events if e["event"] == "process restarted"]  # heartbeats got through CURVE too


def test_the_keys_stay_in_the_private_directory(curve_server):
    _, request_endpoint, _, _ = curve_server
    socket_dir = os.path.dirname(request_endpoint.removeprefix("ipc://"))
    assert oct(os.stat(socket_dir).st_mode & 0o777) == oct(0o700)
    for name in os.listdir(os.path.join(socket_dir, "zmq-curve", "private")):
        assert os.stat(os.path.join(socket_dir, "zmq-curve", "private", name)).st_mode & 0o077 == 0
