"""Tensor parallelism through the real ``pagedserve serve`` processes.

- A tiny random GQA model (4 heads, 2 KV heads) with ``-tp 2`` (one KV head per rank) and
  ``-tp 4`` (each KV head replicated on two ranks) answers one workload exactly as ``-tp 1``
  does: the same greedy and seeded tokens, logprobs within float32 noise, with prefill and decode
  mixed in steps, a prefix-cache hit, a forked ``n = 2`` request and preemptions by swap in the
  same run. ``/health`` and ``/metrics`` report the group; each rank's KV pool holds only its KV
  heads. The same across two "hosts" (two serve commands, ``--nnodes 2``, torch.distributed and
  ``tcp://`` endpoints).
- SmolLM2-135M with ``-tp 3`` against transformers: ``tests/system/test_server_tensor_parallel_smollm2.py``.
- A rank killed (over both all-reduce kinds), or stopped (hung), mid-run: serve restarts the whole
  group under a new group id, the streams in flight end exactly as an uninterrupted run's, and no
  process or shared-memory segment of the lost group is left. With ``--max-restarts 0`` a killed
  rank ends serve instead, naming the rank.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from loadtest.common.procs import child_argvs
from tests.doubles.serve import openai_client, start_server, save_tiny_model, stop
from tests.system.test_server_api import wait_until_idle

pytestmark = pytest.mark.slow

TINY_FLAGS = ["--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "64", "--preemption-mode", "swap",
              "--max-num-batched-tokens", "32", "--swap-space", "0.01", "--max-model-len", "256"]
PREFIX = list(range(1000, 1024))  # 24 tokens: 6 full blocks shared by two prompts


@pytest.fixture(scope="module")
def tiny_gqa_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read().decode()


def _choices(reply) -> list[dict]:
    return [{"tokens": c.logprobs.tokens, "logprobs": c.logprobs.token_logprobs, "text": c.text}
            for c in sorted(reply.choices, key=lambda c: c.index)]


class _Stream(threading.Thread):
    """A streamed greedy completion; records each token and when it arrived."""

    def __init__(self, client, model: str, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.prompt, self.max_tokens = client, model, prompt, max_tokens
        self.tokens, self.logprobs, self.times = [], [], []
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            stream = self.client.completions.create(model=self.model, prompt=self.prompt, max_tokens=self.max_tokens,
                                                    temperature=0, logprobs=1, stream=True,
                                                    extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.tokens:
                    self.tokens += chunk.choices[0].logprobs.tokens
                    self.logprobs += chunk.choices[0].logprobs.token_logprobs
                    self.times.append(time.monotonic())
                    self.first.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.first.set()


def run_workload(url: str, model: str) -> dict:
    """One run that mixes prefill and decode, hits the prefix cache, forks n=2 and preempts by swap.

    A decodes 120 tokens throughout. C then D share a 6-block prefix (D's hit). Then B's 70-token
    prompt is prefilled in chunks of the 32-token budget while A decodes, and E (n=2, seeded), F
    and G push the pool (64 blocks of 4) past its size so that groups are swapped out: F and G
    alone grow to 36 blocks each (72 > 64), so this holds however fast A, B and E went (at 30
    blocks each it took E's 19 besides them, and a fast executor finished E first). F and G are one
    request with two prompts (choices 0 and 1)."""
    client = openai_client(url)

    def complete(prompt, max_tokens, **sampling):
        sampling = {"temperature": 0, **sampling}
        return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, logprobs=1,
                                         extra_body={"ignore_eos": True}, **sampling)

    a = _Stream(client, model, list(range(300, 312)), 120)
    a.start()
    assert a.first.wait(120) and a.error is None, a.error
    c = complete(PREFIX + list(range(40, 46)), 4)
    d = complete(PREFIX + list(range(60, 68)), 4)
    b = _Stream(client, model, list(range(2000, 2070)), 20)
    b.start()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        e = pool.submit(complete, list(range(500, 510)), 30, n=2, temperature=0.8, seed=7)
        # F and G in one request, so that they arrive together however busy the machine is: the
        # pool overflows only while both run (sent apart, G more than ~32 steps after F fit beside it)
        fg = pool.submit(complete, [list(range(600, 620)), list(range(700, 720))], 124)
        replies = {"C": c, "D": d, "E": e.result(), "F and G": fg.result()}
    for stream in (a, b):
        stream.join(300)
        assert not stream.is_alive() and stream.error is None, stream.error
    out = {name: _choices(reply) for name, reply in replies.items()}
    out["A"] = [{"tokens": a.tokens, "logprobs": a.logprobs, "text": "".join(a.tokens)}]
    out["B"] = [{"tokens": b.tokens, "logprobs": b.logprobs, "text": "".join(b.tokens)}]
    health = _health_after_run(url)
    return {"choices": out, "health": health, "d_cached_tokens": d.usage.prompt_tokens_details.cached_tokens,
            "a_decoded_during_b_prefill": a.times[-1] > b.times[0],
            "num_preemptions": sum(r.usage.model_extra["num_preemptions"] for r in replies.values()),
            "metrics": _get(f"{url}/metrics")}


def _health_after_run(url: str, timeout_s: float = 120.0) -> dict:
    """/health once its stats show the run, over: the scheduler's stats reach it every 0.5 s, so
    right after the replies it may still show the run's middle, or (seen once in CI on a loaded
    machine) an idle pool with nothing run yet; idle alone does not tell those apart, having run
    (``max_num_running``) and then being idle does."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = json.loads(_get(f"{url}/health"))
        if health["max_num_running"] > 0 and health["num_running"] == health["num_waiting"] == health["num_blocks_used"] == 0:
            return health
        assert time.monotonic() < deadline, f"/health did not show the finished run within {timeout_s} s: {health}"
        time.sleep(0.05)


def _check_runs_features(run: dict) -> None:
    assert run["d_cached_tokens"] == len(PREFIX), "D did not reuse C's prefix blocks"
    assert run["a_decoded_during_b_prefill"], "A finished before B's chunked prefill: no mixed step"
    assert len(run["choices"]["E"]) == 2 and run["choices"]["E"][0]["tokens"] != run["choices"]["E"][1]["tokens"]
    assert run["health"]["num_preemptions_by_mode"]["swap"] > 0, f"no group was swapped out: {run['health']}"
    assert len(run["choices"]["F and G"]) == 2
    assert all(len(c["tokens"]) == n for name, n in (("A", 120), ("B", 20), ("F and G", 124)) for c in run["choices"][name])


def _check_same_outputs(got: dict, expected: dict, label: str) -> None:
    for name, choices in expected["choices"].items():
        for i, (g, e) in enumerate(zip(got["choices"][name], choices, strict=True)):
            assert g["tokens"] == e["tokens"], f"{label}: request {name} choice {i} differs"
            worst = max(abs(x - y) for x, y in zip(g["logprobs"], e["logprobs"]))
            assert worst < 1e-4, f"{label}: request {name} choice {i}: logprobs differ by {worst}"


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory, tiny_gqa_dir):
    # lock-step: the reference of the sharded runs and of the overlapped loop's
    proc, url = start_server(tmp_path_factory.mktemp("tp1"), "--model", str(tiny_gqa_dir), *TINY_FLAGS,
                       "--no-async-scheduling")
    try:
        run = run_workload(url, tiny_gqa_dir.name)
    finally:
        stop(proc)
    _check_runs_features(run)
    assert run["health"]["group"]["world_size"] == 1
    return run


@pytest.mark.parametrize("world_size", [2, 4])
def test_tiny_gqa_model_sharded_equals_one_rank(world_size, tmp_path, tiny_gqa_dir, tp1_run):
    """The workload as at -tp 1; then (``--max-restarts 0``) rank 1 killed mid-request ends serve,
    naming the rank (``_end_by_killing_rank_1``: on this server, rather than on one started for it)."""
    proc, url = start_server(tmp_path, "--model", str(tiny_gqa_dir), "-tp", str(world_size), *TINY_FLAGS,
                       "--max-restarts", "0")
    try:
        run = run_workload(url, tiny_gqa_dir.name)
        _end_by_killing_rank_1(proc, url, tmp_path, tiny_gqa_dir.name, world_size)
    finally:
        stop(proc)
    _check_runs_features(run)
    _check_same_outputs(run, tp1_run, f"-tp {world_size}")
    group, full_bytes = run["health"]["group"], tp1_run["health"]["group"]["kv_cache_bytes_per_rank"][0]
    assert group["world_size"] == world_size and group["all_reduce"] == "shm"
    assert group["num_kv_blocks_per_rank"] == [64] * world_size
    # 2 KV heads: one per rank at -tp 2, and at -tp 4 (replicated): half the one-rank pool each
    assert group["kv_cache_bytes_per_rank"] == [full_bytes // 2] * world_size
    assert f"pagedserve:tensor_parallel_size {world_size}.0" in run["metrics"].splitlines()
    assert 'pagedserve:all_reduce_info{kind="shm"} 1.0' in run["metrics"].splitlines()
    log = (tmp_path / "serve.log").read_text()
    assert log.count('"event": "model loaded"') == world_size
    assert '"event": "executor group ready"' in log


# -tp 2 only: the scheduler's overlapped loop is the same at any size, and one rank is covered
# in-process (tests/scheduler/test_async_equivalence.py, tiny Llama tokens and logprobs) and through serve
# (tests/system/test_server_faults.py: the async server's streams equal the lock-step server's)
@pytest.mark.parametrize("world_size", [2])
def test_async_scheduling_equals_lock_step(world_size, tmp_path, tiny_gqa_dir, tp1_run):
    """``--async-scheduling`` over the same workload: lock-step's tokens; with ``-tp 2`` every rank
    puts rank 0's sampled tokens in the placeholders (a rank that did not would diverge)."""
    proc, url = start_server(tmp_path, "--model", str(tiny_gqa_dir), "-tp", str(world_size), "--async-scheduling",
                       *TINY_FLAGS)
    try:
        run = run_workload(url, tiny_gqa_dir.name)
    finally:
        stop(proc)
    _check_runs_features(run)
    _check_same_outputs(run, tp1_run, f"--async-scheduling -tp {world_size}")
    assert '"async_scheduling": true' in (tmp_path / "serve.log").read_text()


def _free_port_run(length: int) -> int:
    """A port p with p .. p + length - 1 all free on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for p in range(port, port + length):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def test_two_hosts_over_torch_distributed(tmp_path, tiny_gqa_dir, tp1_run):
    """Host 0 runs the scheduler, the frontend and rank 0; "host 1" (another serve) rank 1."""
    port = _free_port_run(3)
    group = ["--model", str(tiny_gqa_dir), "-tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}"]
    with open(tmp_path / "node1.log", "w") as node1_log:
        node1 = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", *group, "--node-rank", "1",
                                  *TINY_FLAGS], stdout=node1_log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        proc, url = start_server(tmp_path, *group, *TINY_FLAGS)
        try:
            run = run_workload(url, tiny_gqa_dir.name)
        finally:
            stop(proc)
        assert node1.wait(timeout=30) == 0  # the scheduler's Shutdown reached rank 1, which stopped cleanly
    finally:
        stop(node1)
    _check_runs_features(run)
    _check_same_outputs(run, tp1_run, "-tp 2 on two hosts")
    assert run["health"]["group"]["all_reduce"] == "torch"
    assert '"rank": 1' in (tmp_path / "node1.log").read_text()


# ---------------------------------------------------------------- a rank that dies or hangs


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """Executor rank -> pid, from the launcher's children's command lines."""
    return {int(argv[argv.index("--rank") + 1]): child for child, argv in child_argvs(launcher_pid).items()
            if "executor" in argv and "--rank" in argv}


def _group_ids(log_path) -> list[str]:
    """The launcher's executor groups, in the order it started them."""
    return [json.loads(line)["group_id"] for line in log_path.read_text().splitlines()
            if line.startswith("{") and '"event": "executor group"' in line]


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


def _segments(group_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"psv-{group_id}-")]


def _executor_restarts(url: str) -> float:
    line = next(line for line in _get(f"{url}/metrics").splitlines()
                if line.startswith('pagedserve:process_restarts_total{process="executor"}'))
    return float(line.rsplit(" ", 1)[1])


RESTART_PROMPTS = [list(range(300 + 40 * i, 312 + 40 * i)) for i in range(3)]
# Tokens per stream, by all-reduce kind: the fault is sent as soon as each stream has its first
# token, and the rest must outlast that. A torch.distributed step takes about 10 ms here (100 steps:
# about 1 s), a shared-memory step about 3 ms (so 200 there). 3 x (12 + 200) tokens fit in 256
# blocks of 4: no preemption needed.
RESTART_MAX_TOKENS = {"torch": 100, "shm": 200}


# killed over torch.distributed, stopped (hung) over shared memory: each all-reduce kind restarts
@pytest.mark.parametrize(("all_reduce", "how"), [("torch", signal.SIGKILL), ("shm", signal.SIGSTOP)],
                         ids=["torch-killed", "shm-stopped"])
def test_a_lost_rank_restarts_the_group_and_streams_continue(all_reduce, how, tmp_path, tiny_gqa_dir):
    """-tp 2, three greedy streams; rank 1 is killed (or stopped: its heartbeats stop, and the
    scheduler gives up on it after --heartbeat-timeout, before rank 0's --group-timeout) mid-run.
    serve stops both ranks and starts a new group; the streams end with exactly the tokens of an
    uninterrupted run, one restart is counted, and no process or segment of the first group is left."""
    max_tokens = RESTART_MAX_TOKENS[all_reduce]
    proc, url = start_server(tmp_path, "--model", str(tiny_gqa_dir), "-tp", "2", *TINY_FLAGS, "--num-kv-blocks", "256",
                       "--all-reduce", all_reduce, "--group-timeout", "5", "--heartbeat-timeout", "3")
    log_path = tmp_path / "serve.log"
    try:
        client, model = openai_client(url), tiny_gqa_dir.name
        with concurrent.futures.ThreadPoolExecutor(len(RESTART_PROMPTS)) as pool:  # batched as the streams are
            reference = list(pool.map(lambda p: _choices(client.completions.create(
                model=model, prompt=p, max_tokens=max_tokens, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True}))[0]["tokens"], RESTART_PROMPTS))
        [first_group], old_ranks = _group_ids(log_path), _rank_pids(proc.pid)
        assert sorted(old_ranks) == [0, 1] and _executor_restarts(url) == 0
        streams = [_Stream(client, model, p, max_tokens) for p in RESTART_PROMPTS]
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.first.wait(120) and stream.error is None, stream.error
        os.kill(old_ranks[1], how)
        assert all(len(s.tokens) < max_tokens for s in streams), "a stream ended before the fault"
        for stream in streams:
            stream.join(300)
            assert not stream.is_alive() and stream.error is None, stream.error
        assert [s.tokens for s in streams] == reference  # no token lost or repeated
        assert _executor_restarts(url) == 1
        new_groups, new_ranks = _group_ids(log_path), _rank_pids(proc.pid)
        assert len(new_groups) == 2 and new_groups[1] != first_group
        assert sorted(new_ranks) == [0, 1] and not set(new_ranks.values()) & set(old_ranks.values())
        assert all(_gone(pid) for pid in old_ranks.values())
        assert _segments(first_group) == [], "a segment of the first group was left"
        health = json.loads(_get(f"{url}/health"))
        assert health["group"]["world_size"] == 2 and [e["status"] for e in health["processes"]["executors"]] == [
            "ok", "ok"]
        wait_until_idle(url, 120)  # every block free again
    finally:
        stop(proc)
    assert not [g for g in _group_ids(log_path) if _segments(g)], "a segment was left"
    log = log_path.read_text()
    assert log.count('"event": "process restarted"') == 1 and '"service": "executor"' in log


def _end_by_killing_rank_1(proc: subprocess.Popen, url: str, tmp_path, model: str, world_size: int) -> None:
    """serve started with ``--max-restarts 0``: rank 1 killed mid-request stops serve (exit 1),
    naming the rank; no rank process or segment of the group is left."""
    [group_id], ranks = _group_ids(tmp_path / "serve.log"), _rank_pids(proc.pid)
    assert sorted(ranks) == list(range(world_size))
    stream = _Stream(openai_client(url), model, list(range(300, 312)), 200)
    stream.start()
    assert stream.first.wait(120)
    os.kill(ranks[1], signal.SIGKILL)
    assert proc.wait(timeout=90) == 1
    assert all(_gone(pid) for pid in ranks.values())
    assert _segments(group_id) == [], "a segment was left"
    [message] = [line for line in (tmp_path / "serve.log").read_text().splitlines() if line.startswith("pagedserve: ")]
    assert message.startswith("pagedserve: the executor process failed 1 time within 600 s (--max-restarts 0, "
                              "--restart-window-s 600); last: executor rank 1 was killed by SIGKILL")
    assert message.endswith("; stopped the others")
