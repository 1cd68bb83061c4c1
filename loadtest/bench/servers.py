"""Starting ``pagedserve serve`` (or any OpenAI-compatible server) for a benchmark and waiting until it
is ready: a free port, ``/health``, and the model name it serves."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

from loadtest.bench.throughput_report import say


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=2) as resp:
        return json.loads(resp.read())


def start_server(flags: list[str], log_path: str = "/tmp/pagedserve-throughput-server.log"
                 ) -> tuple[subprocess.Popen, str]:
    """Start ``pagedserve serve`` on a free 127.0.0.1 port (its output in ``log_path``) and wait until
    ``/health`` says ok; returns the process and its URL."""
    port = _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, log_path)
    return proc, url


def wait_until_healthy(proc: subprocess.Popen, url: str, log_path: str, name: str = "server",
                       timeout_s: float | None = None) -> None:
    """Wait until the server ``proc`` at ``url`` says ``/health`` ok (a progress line every 3 s);
    ``SystemExit`` naming ``log_path`` when it exits first or ``timeout_s`` passes."""
    t0 = last_said = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}; see {log_path}")
        try:
            if _get_json(f"{url}/health")["status"] == "ok":
                return
        except OSError:
            pass
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"{name} not ready in {timeout_s:.0f} s; see {log_path}")
        if time.monotonic() - last_said >= 3:  # a progress line every 3 s; polled more often
            last_said = time.monotonic()
            say(f"  waiting for the {name} ({last_said - t0:.0f} s)")
        time.sleep(0.1)


def served_model_name(url: str) -> str:
    """The first model a server serves (vLLM names it after its checkpoint path; a pagedserve given
    with ``--url`` may serve any model)."""
    return _get_json(f"{url}/v1/models")["data"][0]["id"]
