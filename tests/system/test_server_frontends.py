"""Several frontends on one scheduler: ``pagedserve serve`` on a tiny random Llama, and more frontend
processes on its request endpoint. Every request's outputs reach the frontend that sent it, and a
frontend that vanishes without a word has its requests aborted at the scheduler."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from shared.endpoints import Endpoints
from tests.doubles.serve import free_port, wait_healthy, stop

pytestmark = pytest.mark.slow

MODEL = "tiny"
GREEDY = dict(model=MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _start_frontend(root, model_dir, request_endpoint: str, label: str) -> tuple[subprocess.Popen, str]:
    """One more frontend process (``pagedserve frontend``) on ``request_endpoint``."""
    port = free_port()
    log = open(root / f"{label}.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "frontend", "--model", str(model_dir), "--served-model-name", MODEL,
         "--port", str(port), "--request-endpoint", request_endpoint],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


@pytest.fixture(scope="module")
def deployment(tiny_model_dir, tiny_f32_server):
    """(model directory, log folder, the request endpoint, the first frontend's URL): the session's
    float32 server (conftest.py), served as ``MODEL``."""
    url, root = tiny_f32_server
    [socket_dir] = [p for p in root.iterdir() if p.name.startswith("pagedserve-")]
    return tiny_model_dir, root, Endpoints.in_directory(str(socket_dir)).request, url


@pytest.fixture(scope="module")
def second_url(deployment):
    model_dir, root, endpoint, _ = deployment
    proc, url = _start_frontend(root, model_dir, endpoint, "frontend-2")
    yield url
    stop(proc)


def _text(url: str, prompt: str, stream: bool) -> str:
    client = _client(url)
    if not stream:
        return client.completions.create(prompt=prompt, **GREEDY).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(prompt=prompt, stream=True, **GREEDY)
                   if c.choices)


def test_forty_requests_over_two_frontends_equal_one_frontend_runs(deployment, second_url):
    first_url = deployment[3]
    prompts = [f"Request {i} is about the number {i * 7}:" for i in range(40)]
    urls = [first_url, second_url]
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        both = list(pool.map(lambda i: _text(urls[i % 2], prompts[i], stream=i % 4 < 2), range(40)))
    one = [_text(first_url, p, stream=False) for p in prompts]  # one at a time, one frontend
    assert both == one
    assert len(set(one)) > 1  # the prompts do lead to different answers


def _health(url: str) -> dict:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read())


def test_a_vanished_frontends_requests_are_aborted(deployment):
    model_dir, root, endpoint, first_url = deployment
    proc, url = _start_frontend(root, model_dir, endpoint, "frontend-doomed")
    try:
        client = _client(url)
        streams = [client.completions.create(model=MODEL, prompt=f"Story {i}:", n=4, temperature=1.0, seed=i,
                                             max_tokens=240, stream=True, extra_body={"ignore_eos": True})
                   for i in range(8)]
        next(iter(streams[-1]))  # tokens are flowing for the last one
        proc.send_signal(signal.SIGKILL)  # no chance to send aborts
        proc.wait(timeout=10)
    finally:
        stop(proc)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        health = _health(first_url)
        if health["num_running"] == health["num_waiting"] == health["num_blocks_used"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the scheduler still runs the vanished frontend's requests: {health}")
    identity = next(e["identity"] for e in _events(root / "frontend-doomed.log")
                    if e.get("event") == "connected to the scheduler")
    deadline = time.monotonic() + 60  # the launcher forwards the scheduler's log lines a little later
    while True:
        events = _events(root / "serve.log")
        gone = [e for e in events if e.get("event") == "frontend gone" and e["frontend"] == identity]
        aborted = {e["request_id"] for e in events if e.get("event") == "request aborted: its frontend is gone"}
        if gone and len(aborted) >= gone[0]["num_requests"]:
            break
        assert time.monotonic() < deadline, f"the scheduler did not abort the frontend's requests: {gone}"
        time.sleep(0.2)
    assert gone[0]["num_requests"] > 0, "no request was left to abort: the test proves nothing"
    finished = {e["request_id"] for e in events if e.get("event") == "request finished"}
    assert len(aborted) == gone[0]["num_requests"] and not aborted & finished


def _events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
