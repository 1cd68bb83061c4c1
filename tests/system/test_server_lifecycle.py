"""``pagedserve serve`` from start to stop under failures (a tiny random Llama): processes killed
while they start up are replaced and counted, SIGTERM during start-up stops everything, too many
restarts stop the server with a clear message, and nothing is left behind (processes, the socket
directory, shared memory). The helpers are the fault tests' (``test_server_faults``).

Every check is on behaviour (counts, exit codes, what is left); the timeouts only guard against hangs.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.doubles.serve import wait_healthy
from tests.system.test_server_faults import (
    GREEDY, RECOVERY_S, _alive, _child, _client, _health, _health_restarts, _restarts, _serve, _started_pids,
    _stop, _wait_for,
)

pytestmark = pytest.mark.slow


def test_restarts_and_kills_during_start_up_leave_nothing_behind_and_are_counted(tmp_path, tiny_model_dir):
    """Each process killed while it starts up (before any other heard of it), then more restarts in
    a row: /metrics counts every replaced process once, across the frontend's own restart, and
    /health reports the same counts."""
    proc, url = _serve(tmp_path, tiny_model_dir, "--heartbeat-timeout", "3", wait=False)
    try:
        for victim in ("executor", "scheduler", "frontend"):
            os.kill(_child(proc, victim), signal.SIGKILL)  # while it loads
        wait_healthy(url, proc)
        assert _restarts(url) == {"executor": 1, "scheduler": 1, "frontend": 1}
        assert _health_restarts(url) == {"executor": [1], "scheduler": 1, "frontend": 1}
        for victim in ("executor", "executor", "scheduler", "frontend"):  # restarts in a row
            killed = _child(proc, victim)
            os.kill(killed, signal.SIGKILL)
            _wait_for(lambda: _health(url)[0] == 200 and _child(proc, victim) != killed, f"no new {victim}")
        assert _client(url).completions.create(prompt="Hello", **GREEDY).usage.completion_tokens == 120
        assert _restarts(url) == {"executor": 3, "scheduler": 2, "frontend": 2}
        assert _health_restarts(url) == {"executor": [3], "scheduler": 2, "frontend": 2}
    finally:
        assert _stop(proc) == 0
    started = _started_pids(tmp_path)
    assert len(started) == 3 + 7  # the first three, and seven restarts
    assert not [pid for pid in started if _alive(pid)], "orphan processes"
    assert not [p for p in os.listdir(tmp_path) if p.startswith("pagedserve-")], "socket directory left behind"
    # (A one-rank server makes no shared-memory segments; the tensor-parallel restart tests check
    # that a group's segments go with it: tests/system/test_server_tensor_parallel.py.)
    log = (tmp_path / "serve.log").read_text()
    assert log.count('"process restarted"') == 7 and "was killed by SIGKILL" in log


def test_sigterm_during_start_up_stops_everything(tmp_path, tiny_model_dir):
    proc, _ = _serve(tmp_path, tiny_model_dir, wait=False)
    _child(proc, "frontend")
    _child(proc, "executor")
    assert _stop(proc) == 0
    started = _started_pids(tmp_path)
    assert len(started) == 3 and not [pid for pid in started if _alive(pid)]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("pagedserve-")]


def test_too_many_restarts_stop_the_server_with_a_clear_message(tmp_path, tiny_model_dir):
    proc, url = _serve(tmp_path, tiny_model_dir, "--max-restarts", "1", "--restart-window-s", "600")
    try:
        os.kill(_child(proc, "executor"), signal.SIGKILL)
        _wait_for(lambda: _restarts(url)["executor"] == 1 and _health(url)[0] == 200, "no restart")
        os.kill(_child(proc, "executor"), signal.SIGKILL)
        assert proc.wait(timeout=RECOVERY_S) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (tmp_path / "serve.log").read_text()
    assert ("pagedserve: the executor process failed 2 times within 600 s (--max-restarts 1, "
            "--restart-window-s 600); last: was killed by SIGKILL") in log
    assert not [pid for pid in _started_pids(tmp_path) if _alive(pid)]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("pagedserve-")]
