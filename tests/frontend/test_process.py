"""``run_frontend`` as a real process: flags, tokenizer loading, serving, clean SIGTERM shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from shared.endpoints import Endpoints
from tests.doubles.fake_scheduler import (
    SLOW_MARKER, FakeScheduler, FrontendThread, cached_tokenizer, default_served_model,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.slow  # a fresh process loads the tokenizer
def test_frontend_process_serves_and_stops_on_sigterm(tmp_path):
    endpoints = Endpoints.in_directory(str(tmp_path))
    port = free_port()
    env = os.environ | {
        "PAGEDSERVE_REQUEST_ENDPOINT": endpoints.request,
        "PAGEDSERVE_LOG_FORMAT": "json",
        "PYTHONPATH": str(REPO_ROOT),
    }
    cmd = [sys.executable, "-m", "services.frontend.main", "--port", str(port), "--max-model-len", "256",
           "--served-model-name", "smol"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    fake = None
    try:
        fake = FakeScheduler(endpoints, cached_tokenizer()).start()  # binds after the frontend connects: fine
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240  # only against a hang: a loaded machine starts it slowly
        while True:
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            try:
                status, _ = get(url + "/health")
                if status == 200:
                    break
            except OSError:
                pass  # not listening yet: the tokenizer takes seconds to load
            assert time.monotonic() < deadline, "the frontend did not become healthy within 240 s"
            time.sleep(0.2)
        status, body = get(url + "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == "smol"
        assert json.loads(body)["data"][0]["max_model_len"] == 256
        request = urllib.request.Request(
            url + "/v1/completions", json.dumps({"model": "smol", "prompt": "hi", "max_tokens": 4}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if fake is not None:
            fake.stop()
    assert proc.returncode == 0, stderr.decode()[-3000:]
    events = [json.loads(line) for line in stderr.decode().splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    for expected in ("loading tokenizer", "tokenizer loaded", "frontend listening", "shutting down frontend",
                     "frontend stopped"):
        assert expected in names, names
    assert all(e.get("process") == "frontend" for e in events)
    sent = next(e for e in events if e["event"] == "request sent")
    assert sent["request_id"].startswith("cmpl-")


def test_shutdown_ends_running_streams_and_aborts_them(tmp_path):
    """Past the grace period, a running stream gets an error event and [DONE]; the scheduler an abort."""
    endpoints = Endpoints.in_directory(str(tmp_path))
    model = default_served_model(max_model_len=256)
    fake = FakeScheduler(endpoints, model.tokenizer).start()
    frontend = FrontendThread(model, endpoints, shutdown_grace_s=0.2).start()
    received: list[bytes] = []

    async def stream_until_closed() -> None:
        body = {"prompt": SLOW_MARKER, "max_tokens": 200, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(frontend.base_url + "/v1/completions", json=body) as resp:
                async for line in resp.content:
                    received.append(line)

    reader = threading.Thread(target=lambda: asyncio.run(stream_until_closed()))
    try:
        reader.start()
        assert fake.wait_for(lambda f: len(f.added) == 1, timeout=60)
        frontend.stop()
        reader.join(timeout=60)
        assert fake.wait_for(lambda f: f.aborted == [f.added[0].request_id], timeout=60)
    finally:
        fake.stop()
    events = [line for line in received if line.strip()]
    assert events[-1] == b"data: [DONE]\n"
    assert json.loads(events[-2][len(b"data: "):])["error"]["message"] == "the server is shutting down"
    chunks = [json.loads(line[len(b"data: "):]) for line in events[:-2]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # cut off, not run to its end


def test_bad_flag_fails_with_its_name():
    result = subprocess.run(
        [sys.executable, "-m", "services.frontend.main", "--port", "99999", "--request-endpoint", "ipc:///tmp/r"],
        cwd=REPO_ROOT, capture_output=True, timeout=60, env=os.environ | {"PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 2 and b"--port must be" in result.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
