"""Processes that die or hang under ``pagedserve serve`` (a tiny random Llama): the supervisor
replaces them, requests in flight continue where they were, /health and /metrics tell the truth,
and nothing is left behind.

Every check is on behaviour (texts, counts, what is left); the timeouts only guard against hangs.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.doubles.serve import children_of, free_port, wait_healthy
from tests.system.test_server_api import metrics, wait_until_idle

pytestmark = pytest.mark.slow

MODEL = "tiny"
PROMPTS = [f"Story number {i}: once upon a time" for i in range(8)]
GREEDY = dict(model=MODEL, max_tokens=120, temperature=0, extra_body={"ignore_eos": True})
POISON_DIR = Path(__file__).resolve().parents[1] / "doubles" / "poison_executor"
POISON_TOKEN_ID = 49151  # tests/doubles/poison_executor/sitecustomize.py kills the executor on it
RECOVERY_S = 240.0  # a guard against hangs only
# rounds of streams started until one is caught with every stream midway (see Streams.midway_of)
MIDWAY_TRIES = 5
# what the stopped-executor tests wait out: a tiny-model step takes milliseconds (the kernels are
# loaded during the executor's warm-up), so 3 s is still a wide margin on a loaded machine
STEP_TIMEOUT_S = "3"


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=RECOVERY_S)


def _serve(root: Path, model_dir: Path, *flags: str, env: dict | None = None,
           wait: bool = True) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "--port", str(port), "--model", str(model_dir),
         "--served-model-name", MODEL, "--dtype", "float32", "--kv-cache-memory", "16MiB", *flags],
        env={**os.environ, "TMPDIR": str(root), **(env or {})}, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    if wait:
        wait_healthy(url, proc)
    return proc, url


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def _child(proc: subprocess.Popen, name: str) -> int:
    """The pid of ``serve``'s ``name`` process (waits for it to exist)."""
    deadline = time.monotonic() + RECOVERY_S
    while time.monotonic() < deadline:
        pids = [pid for pid, service in children_of(proc.pid).items() if service == name]
        if pids:
            return pids[0]
        time.sleep(0.05)
    raise TimeoutError(f"no {name} process")


def _restarts(url: str) -> dict[str, float]:
    m = metrics(url)
    return {p: m[f'pagedserve:process_restarts_total{{process="{p}"}}'] for p in ("executor", "scheduler", "frontend")}


def _health_restarts(url: str) -> dict[str, int | list[int]]:
    """/health's restart counts: each executor rank's, the scheduler's and the frontend's."""
    processes = _health(url)[1]["processes"]
    return {"executor": [e["num_restarts"] for e in processes["executors"]],
            "scheduler": processes["scheduler"]["num_restarts"], "frontend": processes["frontend"]["num_restarts"]}


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _wait_for(predicate, what: str, timeout: float = RECOVERY_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except OSError:  # the frontend is restarting
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(what)


def _started_pids(root: Path) -> set[int]:
    """Every process the launcher started, from its log."""
    pids = set()
    for line in (root / "serve.log").read_text().splitlines():
        if line.startswith("{") and '"process started"' in line:
            pids.add(json.loads(line)["child_pid"])
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Streams:
    """Greedy streams of ``PROMPTS`` in threads, started together; ``midway_of`` starts them and
    returns once each has had a few chunks and none has finished."""

    def __init__(self, url: str, prompts: list[str] = PROMPTS) -> None:
        self.client = _client(url)
        self.prompts = prompts
        self.texts = [""] * len(prompts)
        self.num_chunks = [0] * len(prompts)
        self.finish_reasons: list[str | None] = [None] * len(prompts)
        self.errors: list[BaseException | None] = [None] * len(prompts)
        self._go = threading.Barrier(len(prompts))  # every thread sends its request at once
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(len(prompts))]
        for thread in self.threads:
            thread.start()

    def _run(self, i: int) -> None:
        self._go.wait()
        try:
            for chunk in self.client.completions.create(prompt=self.prompts[i], stream=True, **GREEDY):
                if chunk.choices:
                    self.texts[i] += chunk.choices[0].text
                    self.num_chunks[i] += 1
                    self.finish_reasons[i] = chunk.choices[0].finish_reason or self.finish_reasons[i]
        except BaseException as exc:  # noqa: BLE001 - recorded for the test to assert on
            self.errors[i] = exc

    @classmethod
    def midway_of(cls, url: str, prompts: list[str] = PROMPTS) -> "Streams":
        """Streams of ``prompts``, each past its first few chunks and none finished: the moment at
        which a fault proves something. On a loaded machine one stream can start so late that
        another has finished by then (a tiny model's 120 tokens take well under a second); such a
        round is left to finish and a new one started, up to ``MIDWAY_TRIES`` rounds."""
        for _ in range(MIDWAY_TRIES):
            streams = cls(url, prompts)
            _wait_for(lambda: min(streams.num_chunks) >= 5 or any(streams.errors), "streams did not start")
            assert not any(streams.errors), streams.errors
            if not any(streams.finish_reasons):
                return streams
            streams.join()
        raise AssertionError(f"in each of {MIDWAY_TRIES} rounds a stream finished before the fault: "
                             "the test would prove nothing")

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=RECOVERY_S)
            assert not thread.is_alive(), "a stream hung"


def _reference(url: str, prompts: list[str] = PROMPTS) -> list[str]:
    client = _client(url)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: client.completions.create(prompt=p, **GREEDY).choices[0].text, prompts))


# ---------------------------------------------------------------- one server, one fault after another


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir  # the session's (conftest.py): the servers only read it


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    """A step is overdue after STEP_TIMEOUT_S; heartbeats (30 s) give the step timeout the first word.
    Lock-step (``--no-async-scheduling``): the faults of the default overlapped loop have their own
    test, whose texts must equal this server's."""
    root = tmp_path_factory.mktemp("serve-faults")
    proc, url = _serve(root, model_dir, "--no-async-scheduling", "--step-timeout", STEP_TIMEOUT_S,
                       "--heartbeat-timeout", "30", "--max-restarts", "20")
    yield proc, url, root, _reference(url)
    _stop(proc)


@pytest.mark.parametrize("victim", ["executor", "scheduler"])
def test_killed_process_is_replaced_and_streams_continue_identically(server, victim):
    proc, url, root, reference = server
    before = _restarts(url)
    streams = Streams.midway_of(url)
    os.kill(_child(proc, victim), signal.SIGKILL)
    streams.join()
    assert streams.errors == [None] * len(PROMPTS)
    assert streams.texts == reference  # no token lost or repeated: every stream as if uninterrupted
    assert streams.finish_reasons == ["length"] * len(PROMPTS)
    after = _restarts(url)
    assert after[victim] == before[victim] + 1
    wait_until_idle(url, RECOVERY_S)  # every block free again
    status, health = _health(url)
    assert status == 200 and health["num_blocks_used"] == 0


def test_stopped_executor_is_killed_after_the_step_timeout(server):
    proc, url, root, reference = server
    before = _restarts(url)
    streams = Streams.midway_of(url)
    stopped = _child(proc, "executor")
    os.kill(stopped, signal.SIGSTOP)
    streams.join()
    assert streams.errors == [None] * len(PROMPTS) and streams.texts == reference
    assert not _alive(stopped)
    assert _restarts(url)["executor"] == before["executor"] + 1
    assert "a step is overdue" in (root / "serve.log").read_text()
    wait_until_idle(url, RECOVERY_S)


def test_scheduler_restart_resumes_sampled_and_grouped_requests(server):
    """n > 1 continues choice by choice, best_of (nothing sent yet) runs again; lengths are exact."""
    proc, url, _, _ = server
    client = _client(url)
    sampled = dict(model=MODEL, prompt="Tell me a story", max_tokens=100, temperature=1.0, seed=7,
                   extra_body={"ignore_eos": True})
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        n_stream = pool.submit(lambda: list(client.completions.create(
            n=2, stream=True, stream_options={"include_usage": True}, **sampled)))
        best_of = pool.submit(client.completions.create, n=1, best_of=2, **sampled)
        streams = Streams.midway_of(url, PROMPTS[:2])
        os.kill(_child(proc, "scheduler"), signal.SIGKILL)
        chunks = n_stream.result(timeout=RECOVERY_S)
        streams.join()
        assert best_of.result(timeout=RECOVERY_S).usage.completion_tokens == 100
    ends = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
    assert ends == {0: "length", 1: "length"}
    usage = chunks[-1].usage  # the original prompt's tokens, and exactly max_tokens for each choice
    num_prompt_tokens = client.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=1).usage.prompt_tokens
    assert usage.completion_tokens == 200 and usage.prompt_tokens == num_prompt_tokens
    assert streams.errors == [None, None]
    wait_until_idle(url, RECOVERY_S)


def test_overlapped_loop_gives_the_same_streams_and_recovers_with_two_steps_in_flight(tmp_path, model_dir, server):
    """``--async-scheduling``: the lock-step server's texts, then the same after an executor killed
    and one stopped (overdue) mid-stream, with two steps in flight."""
    reference = server[3]
    proc, url = _serve(tmp_path, model_dir, "--async-scheduling", "--step-timeout", STEP_TIMEOUT_S,
                       "--heartbeat-timeout", "30", "--max-restarts", "20")
    try:
        assert _reference(url) == reference
        for fault in (signal.SIGKILL, signal.SIGSTOP):
            streams = Streams.midway_of(url)
            victim = _child(proc, "executor")
            os.kill(victim, fault)
            streams.join()
            assert streams.errors == [None] * len(PROMPTS) and streams.texts == reference
            _wait_for(lambda: not _alive(victim), "the stopped executor was not replaced")
        assert _restarts(url)["executor"] == 2
        log = (tmp_path / "serve.log").read_text()
        assert '"async_scheduling": true' in log and "a step is overdue" in log
        assert '"num_steps_lost": 2' in log  # (the stopped one had the next step waiting, at least)
        wait_until_idle(url, RECOVERY_S)
        assert _health(url)[1]["num_blocks_used"] == 0
    finally:
        _stop(proc)


def test_killed_frontend_is_replaced_and_its_requests_are_freed(server):
    proc, url, _, _ = server
    streams = Streams.midway_of(url)
    os.kill(_child(proc, "frontend"), signal.SIGKILL)
    streams.join()
    assert all(e is not None for e in streams.errors)  # the connections dropped, as with any server
    _wait_for(lambda: _health(url)[0] == 200, "the frontend did not come back")
    wait_until_idle(url, RECOVERY_S)  # nothing left allocated for the dead frontend's requests
    assert _restarts(url)["frontend"] >= 1
    assert _client(url).completions.create(prompt="Hello", **GREEDY).usage.completion_tokens == 120


# ---------------------------------------------------------------- a request that kills the executor


@pytest.fixture(scope="module")
def poison_server(tmp_path_factory, model_dir):
    """A server whose executors die on a poison prompt (``tests/doubles/poison_executor``), heartbeats
    overdue after 3 s: shared by the poison test and the silent-scheduler test (whose prompts hold
    no poison; each reads only its own process's restarts, counted from its own start)."""
    proc, url = _serve(tmp_path_factory.mktemp("serve-poison"), model_dir, "--heartbeat-timeout", "3",
                       "--max-restarts", "10", env={"PYTHONPATH": os.pathsep.join([str(POISON_DIR), os.getcwd()])})
    yield proc, url
    _stop(proc)


def test_poison_request_is_failed_alone_and_idle_hang_shows_in_health(poison_server):
    proc, url = poison_server
    innocent = PROMPTS[:7]
    reference = _reference(url, innocent)
    before = _restarts(url)["executor"]
    streams = Streams.midway_of(url, innocent)
    with pytest.raises(Exception) as failure:
        _client(url).completions.create(prompt=[5, 6, POISON_TOKEN_ID, 7], **GREEDY)
    assert "executor crashes" in str(failure.value)
    streams.join()
    assert streams.errors == [None] * 7 and streams.texts == reference
    assert _restarts(url)["executor"] == before + 2  # the two crashes that convicted it
    wait_until_idle(url, RECOVERY_S)
    # Idle, the executor stops (SIGSTOP): /health says so within the heartbeat timeout, and the
    # supervisor replaces it.
    stopped = _child(proc, "executor")
    os.kill(stopped, signal.SIGSTOP)
    status, body = _wait_for(lambda: (s := _health(url))[0] == 503 and s, "/health stayed 200")
    assert body["processes"]["executors"][0]["status"] != "ok"
    _wait_for(lambda: _health(url)[0] == 200, "the executor did not come back")
    assert not _alive(stopped) and _restarts(url)["executor"] == before + 3


def test_a_silent_scheduler_makes_health_and_new_requests_answer_503(poison_server):
    """A stopped scheduler: /health and new requests say 503 (with Retry-After) within the heartbeat
    timeout; the stream in flight waits, and finishes once the scheduler runs again."""
    proc, url = poison_server
    before = _restarts(url)["scheduler"]
    reference = _reference(url, PROMPTS[:1])
    streams = Streams.midway_of(url, PROMPTS[:1])
    scheduler = _child(proc, "scheduler")
    os.kill(scheduler, signal.SIGSTOP)
    try:
        status, body = _wait_for(lambda: (h := _health(url))[0] == 503 and h, "/health stayed 200")
        assert "the scheduler has not answered" in body["reason"]
        assert body["processes"]["scheduler"]["status"] == "lost"
        request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(
            {"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode(), headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"]
        assert json.loads(refused.value.read())["error"]["code"] == "engine_unavailable"
    finally:
        os.kill(scheduler, signal.SIGCONT)
    streams.join()
    assert streams.errors == [None] and streams.texts == reference
    _wait_for(lambda: _health(url)[0] == 200, "/health did not come back")
    assert _restarts(url)["scheduler"] == before  # the same process: nothing was restarted
