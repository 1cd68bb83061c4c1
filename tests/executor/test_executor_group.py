"""Executor ranks as a group, driven by a scheduler double over the real sockets.

Two ``ExecutorProcess`` ranks (spawned) join a shared-memory group, answer the scheduler's
``Hello`` with their ``ExecutorReady`` for its epoch, and run steps that the real scheduler
recorded on the unsharded model: rank 0 replies with the same tokens, rank 1 stays silent. Then
rank 1's step raises: it aborts the group and exits 1, and rank 0 stops with ``EXIT_PEER_FAILED``
and an error naming rank 1 and the reason, instead of waiting for it. A group whose processes a
scheduler's ``Hello`` names as retired exits whole (``EXIT_RETIRED``), leaving no segment.
"""

import json
import os
import sys
import time

import pytest
import zmq

from services.executor.main import EXIT_PEER_FAILED, EXIT_RETIRED, ExecutorConfig, ExecutorProcess
from shared.endpoints import Endpoints
from shared.messages import ExecutorReady, Hello, StepResult, decode, encode
from tests.doubles.engine import InProcessEngine, tiny_llama
from tests.doubles.rank_group import RankGroup, group_segments, new_group_id

FAIL_AT_CALL = 3  # rank 1's third step raises


def _rank(rank, world_size, report, endpoints, model_dir, spec, log_dir):
    sys.stderr = open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1)  # the executor's JSON log lines
    os.environ["PAGEDSERVE_LOG_FORMAT"] = "json"
    if rank == 1:
        from services.executor.runner import ModelRunner

        execute, calls = ModelRunner.execute, []

        def failing(self, step):
            if step.step_id < 0:  # the executor's own warm-up (services/executor/warmup.py)
                return execute(self, step)
            calls.append(step.step_id)
            if len(calls) == FAIL_AT_CALL:
                raise RuntimeError("injected")
            return execute(self, step)

        ModelRunner.execute = failing
    config = ExecutorConfig(endpoints, model=model_dir, block_size=4, num_kv_blocks=32, swap_space=0.01,
                            attention_backend="torch", dtype="float32", rank=rank, world_size=world_size,
                            num_threads=1, **spec)
    report({"exit_code": ExecutorProcess(config).run()})


def _recv(sock, kind, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            msg = decode(sock.recv())
            if isinstance(msg, kind):
                return msg
    return None


def _hello_until_ready(pub, pull, epoch: int, **hello) -> dict[int, ExecutorReady]:
    """Say ``Hello`` (repeated: a SUB socket joins late) until both ranks answered ``epoch``."""
    answered: dict[int, ExecutorReady] = {}
    deadline = time.monotonic() + 120
    while len(answered) < 2 and time.monotonic() < deadline:
        pub.send(encode(Hello(epoch, **hello)))
        ready = _recv(pull, ExecutorReady, timeout_s=0.2)
        if ready is not None and ready.epoch == epoch:
            answered[ready.rank] = ready
    assert sorted(answered) == [0, 1], answered
    return answered


def _start_group(tmp_path, model_dir: str):
    endpoints = Endpoints.in_directory(str(tmp_path))
    group_id = new_group_id()
    spec = {"group_id": group_id, "group_store": str(tmp_path / "store")}
    # spawned: a forked child inherits this process's torch and OpenMP state, and can hang in it
    group = RankGroup(_rank, 2, endpoints, model_dir, spec, str(tmp_path), method="spawn")
    ctx = zmq.Context()
    pub, pull = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    pub.bind(endpoints.step)
    pull.bind(endpoints.result)
    return group, group_id, ctx, pub, pull


@pytest.mark.slow  # starts a group of rank processes
def test_a_failed_step_stops_the_group_naming_the_rank(tmp_path):
    hf_model = tiny_llama(seed=8, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    hf_model.save_pretrained(tmp_path / "model")
    engine = InProcessEngine(hf_model, num_blocks=32, block_size=4)
    steps, results, execute = [], [], engine.runner.execute

    def record(step):
        steps.append(step)
        results.append(execute(step))
        return results[-1]

    engine.runner.execute = record
    engine.add("r0", [5, 6, 7, 8, 9], temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.run()
    group, group_id, ctx, pub, pull = _start_group(tmp_path, str(tmp_path / "model"))
    try:
        ready = [_recv(pull, ExecutorReady) for _ in range(2)]  # unasked, once loaded (epoch 0)
        assert sorted(r.rank for r in ready) == [0, 1] and {r.all_reduce for r in ready} == {"shm"}
        assert {r.epoch for r in ready} == {0}
        _hello_until_ready(pub, pull, epoch=1)
        for step in steps:
            step.epoch = 1  # an executor runs only the steps of the scheduler it answered
        for step, expected in zip(steps[:FAIL_AT_CALL - 1], results):
            pub.send(encode(step))
            got = _recv(pull, StepResult)
            assert got.step_id == step.step_id and got.token_ids.tolist() == expected.token_ids.tolist()
        pub.send(encode(steps[FAIL_AT_CALL - 1]))
        exit_codes = group.join(60)  # the ranks stop by themselves (kills and raises if one still runs)
        # rank 0 could not finish the step alone: no result came in its whole lifetime (what it
        # sent before it exited has arrived by now, or within the poll)
        assert _recv(pull, StepResult, timeout_s=1.0) is None
    finally:
        ctx.destroy(linger=0)
        group.join(60)  # after a failure above: kills and raises if a rank still runs (else at once)
    assert exit_codes == [0, 0]  # both ranks reported an exit code and returned
    assert group.wait_for(0, "exit_code")["exit_code"] == EXIT_PEER_FAILED
    assert group.wait_for(1, "exit_code")["exit_code"] == 1
    errors = [json.loads(line) for line in (tmp_path / "rank0.log").read_text().splitlines()
              if '"error"' in line and line.startswith("{")]
    failure = next(e for e in errors if e["event"] == "executor group failed")
    assert failure["blamed_rank"] == 1
    assert "rank 1 failed: step" in failure["error"] and "RuntimeError('injected')" in failure["error"]
    assert group_segments(group_id) == []


@pytest.mark.slow  # starts two executor processes
def test_a_retired_group_exits_whole(tmp_path):
    """A scheduler that lost the group names its processes in ``Hello``: every rank still running
    exits with ``EXIT_RETIRED`` (so that its supervisor starts a new one); others are not touched."""
    tiny_llama(seed=8, num_attention_heads=4, num_key_value_heads=2, hidden_size=64).save_pretrained(tmp_path / "m")
    group, group_id, ctx, pub, pull = _start_group(tmp_path, str(tmp_path / "m"))
    try:
        first = _hello_until_ready(pub, pull, epoch=1)
        assert len({r.incarnation for r in first.values()}) == 2 and all(r.pid for r in first.values())
        # a new scheduler epoch, naming other processes: the ranks answer it and stay
        second = _hello_until_ready(pub, pull, epoch=2, retired_incarnations=[12345])
        assert {r.incarnation for r in second.values()} == {r.incarnation for r in first.values()}
        deadline = time.monotonic() + 60  # a guard: they exit on the first Hello that reaches them
        while any(proc.is_alive() for proc in group.procs) and time.monotonic() < deadline:
            pub.send(encode(Hello(3, retired_incarnations=[r.incarnation for r in first.values()])))
            time.sleep(0.1)
    finally:
        ctx.destroy(linger=0)
        exit_codes = group.join(60)
    assert exit_codes == [0, 0]
    assert [group.wait_for(rank, "exit_code")["exit_code"] for rank in (0, 1)] == [EXIT_RETIRED] * 2
    assert group_segments(group_id) == []
