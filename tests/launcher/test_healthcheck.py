"""``pagedserve health``: heartbeat files for the scheduler and executors, GET /health for the frontend."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time

import pytest

from services.healthcheck import main as health_main
from shared.heartbeat_file import HeartbeatFile, heartbeat_age_s


@pytest.fixture
def health_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_HEALTH_DIR", str(tmp_path))
    return tmp_path


def _age(path: str, age_s: float) -> None:
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_no_heartbeat_fails_and_names_the_file(health_dir, capsys):
    assert health_main(["scheduler"]) == 1
    assert str(health_dir / "scheduler.heartbeat") in capsys.readouterr().err


def test_fresh_heartbeat_passes_and_old_one_fails_with_the_flag_named(health_dir, capsys):
    HeartbeatFile("scheduler").beat()
    assert health_main(["scheduler"]) == 0
    _age(str(health_dir / "scheduler.heartbeat"), 45)
    assert health_main(["scheduler"]) == 1
    assert "older than --max-age-s 30" in capsys.readouterr().err
    assert health_main(["scheduler", "--max-age-s", "60"]) == 0  # a generous limit tolerates a long step


def test_without_a_health_dir_nothing_is_written_and_the_check_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PAGEDSERVE_HEALTH_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    beat = HeartbeatFile("scheduler")
    beat.beat()
    assert beat.path is None and list(tmp_path.iterdir()) == []
    assert health_main(["scheduler"]) == 1
    assert "PAGEDSERVE_HEALTH_DIR is not set" in capsys.readouterr().err


def test_executor_ranks_have_their_own_files(health_dir):
    HeartbeatFile("executor-1").beat()
    assert health_main(["executor"]) == 1
    assert health_main(["executor", "--rank", "1"]) == 0


def test_beats_are_rate_limited(health_dir):
    beat = HeartbeatFile("scheduler", min_interval_s=3600)
    beat.beat()
    _age(beat.path, 100)
    beat.beat()  # within the interval: the file is not touched again
    assert heartbeat_age_s("scheduler", str(health_dir)) >= 99


def test_a_new_process_removes_a_stale_heartbeat(health_dir):
    HeartbeatFile("executor-0").beat()
    assert heartbeat_age_s("executor-0", str(health_dir)) is not None
    HeartbeatFile("executor-0")  # a restarted executor, still loading its model
    assert heartbeat_age_s("executor-0", str(health_dir)) is None
    assert health_main(["executor"]) == 1


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        body = b'{"status": "unavailable", "reason": "no stats from the scheduler yet"}'
        self.send_response(200 if self.path == "/health" and _Health.status == 200 else _Health.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_frontend():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_frontend_answers_by_its_health_route(fake_frontend, capsys):
    _Health.status = 200
    assert health_main(["frontend", "--port", str(fake_frontend)]) == 0
    _Health.status = 503
    assert health_main(["frontend", "--port", str(fake_frontend)]) == 1
    assert "503 (no stats from the scheduler yet)" in capsys.readouterr().err


def test_frontend_not_listening_fails(capsys):
    assert health_main(["frontend", "--port", "1", "--timeout-s", "2"]) == 1
    assert "unreachable" in capsys.readouterr().err


def test_the_cli_runs_it_without_importing_the_services(health_dir):
    HeartbeatFile("scheduler").beat()
    code = ("import sys; from services.cli import main; rc = main(['health', 'scheduler']);"
            "heavy = [m for m in ('torch', 'transformers', 'aiohttp', 'zmq') if m in sys.modules];"
            "print(heavy); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PAGEDSERVE_HEALTH_DIR": str(health_dir)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"
    assert "scheduler: alive" in proc.stdout
