"""How serve lays out ``-dp N`` replicas (no processes): sockets, executor groups, threads, seeds,
supervisor groups and what the frontend is given; and the flag errors before anything starts."""

import pytest

from services.cli import build_parser, main
from services.data_parallel import frontend_request_endpoint, group_kind, plan_replicas
from services.launcher import _build_groups
from shared.cpu_threads import ThreadChoice


def _plans(*flags: str):
    return plan_replicas(build_parser().parse_args(["serve", *flags]), "/run/psv")


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_replica_is_serve_as_always():
    (plan,) = _plans()
    assert plan.endpoints.request == "ipc:///run/psv/request.sock" and plan.group("executor") == "executor"
    assert plan.child_name("scheduler") == "scheduler" and plan.layout.store_path == "/run/psv/group-store"
    groups = _build_groups(plan.args, [plan], {})
    assert list(groups) == ["scheduler", "executor", "frontend"]
    assert groups["frontend"][0].env["PAGEDSERVE_REQUEST_ENDPOINT"] == "ipc:///run/psv/request.sock"
    assert "--num-threads" not in groups["executor"][0].argv  # the executor chooses
    assert plan.health_env({"PAGEDSERVE_HEALTH_DIR": "/tmp/h"}) == {}


def test_replicas_get_their_own_sockets_groups_threads_and_seeds(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_NUM_THREADS", raising=False)
    monkeypatch.setattr("shared.cpu_threads.choose_threads", lambda n: ThreadChoice(6, "test"))
    plans = _plans("-dp", "3", "--seed", "10")
    assert [p.endpoints.step for p in plans] == [f"ipc:///run/psv/r{i}-step.sock" for i in range(3)]
    assert frontend_request_endpoint(plans) == ",".join(f"ipc:///run/psv/r{i}-request.sock" for i in range(3))
    assert [p.args.seed for p in plans] == [10, 11, 12] and [p.args.num_threads for p in plans] == [2, 2, 2]
    assert len({p.layout.store_path for p in plans}) == 3
    groups = _build_groups(plans[0].args, plans, {"X": "1", "PAGEDSERVE_HEALTH_DIR": "/tmp/h"})
    assert list(groups) == ["scheduler 0", "executor 0", "scheduler 1", "executor 1", "scheduler 2", "executor 2",
                            "frontend"]
    assert {group_kind(name) for name in groups} == {"scheduler", "executor", "frontend"}
    for i in range(3):
        (executor,), (scheduler,) = groups[f"executor {i}"], groups[f"scheduler {i}"]
        assert executor.name == f"replica {i} executor" and scheduler.name == f"replica {i} scheduler"
        assert executor.command == "executor" and scheduler.command == "scheduler"
        assert _flag(executor.argv, "--seed") == str(10 + i) and _flag(executor.argv, "--num-threads") == "2"
        for child in (executor, scheduler):
            assert child.env["PAGEDSERVE_RESULT_ENDPOINT"] == f"ipc:///run/psv/r{i}-result.sock"
            assert child.env["X"] == "1" and child.env["PAGEDSERVE_HEALTH_DIR"] == f"/tmp/h/replica-{i}"
    frontend = groups["frontend"][0]
    assert frontend.env["PAGEDSERVE_REQUEST_ENDPOINT"] == frontend_request_endpoint(plans)


def test_replicas_of_ranks_share_the_cores_and_meet_apart(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_NUM_THREADS", raising=False)
    monkeypatch.setattr("shared.cpu_threads.choose_threads", lambda n: ThreadChoice(7, "test"))
    plans = _plans("-dp", "2", "-tp", "2")
    groups = _build_groups(plans[0].args, plans, {})
    for i, plan in enumerate(plans):
        ranks = groups[f"executor {i}"]
        assert [r.name for r in ranks] == [f"replica {i} executor rank 0", f"replica {i} executor rank 1"]
        assert {_flag(r.argv, "--group-id") for r in ranks} == {plan.layout.group_id}
        assert all(_flag(r.argv, "--num-threads") == "1" for r in ranks)  # 7 // (2 replicas x 2 ranks)
    assert plans[0].layout.group_id != plans[1].layout.group_id


def test_threads_given_are_each_rank_s(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_NUM_THREADS", raising=False)
    assert [p.args.num_threads for p in _plans("-dp", "2", "--num-threads", "3")] == [3, 3]
    monkeypatch.setenv("PAGEDSERVE_NUM_THREADS", "5")
    plans = _plans("-dp", "2", "-tp", "2")
    groups = _build_groups(plans[0].args, plans, {})
    assert all(_flag(rank.argv, "--num-threads") == "5" for i in range(2) for rank in groups[f"executor {i}"])
    monkeypatch.setenv("PAGEDSERVE_NUM_THREADS", "0")  # 0: not asked (as the executor reads it)
    monkeypatch.setattr("shared.cpu_threads.choose_threads", lambda n: ThreadChoice(6, "test"))
    assert [p.args.num_threads for p in _plans("-dp", "2")] == [3, 3]


@pytest.mark.parametrize("flags, message", [
    (["-dp", "0"], "-dp/--data-parallel-size must be at least 1"),
    (["-dp", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:29500"], "does not combine with --nnodes"),
    (["-dp", "2", "-tp", "2", "--all-reduce", "torch", "--dist-init-addr", "127.0.0.1:29500"],
     "leave it out"),
])
def test_bad_data_parallel_flags_exit_2_before_starting(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_device_flag_and_each_ranks_gpu_place(monkeypatch):
    """``--device`` reaches every rank; ``--device-index`` numbers this host's ranks of every
    replica in turn (replica 1's after replica 0's), so ``--device cuda`` spreads them over the
    GPUs; a rank whose place is its own rank gets no flag (the executor's default)."""
    monkeypatch.delenv("PAGEDSERVE_NUM_THREADS", raising=False)
    plans = _plans("-dp", "2", "-tp", "2", "--device", "cuda")
    groups = _build_groups(plans[0].args, plans, {})
    places = {}
    for i in range(2):
        for child in groups[f"executor {i}"]:
            assert _flag(child.argv, "--device") == "cuda"
            places[(i, child.rank)] = int(_flag(child.argv, "--device-index")) if "--device-index" in child.argv \
                else child.rank
    assert places == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}
    assert "--device-index" not in groups["executor 0"][1].argv
    (plan,) = _plans()
    assert "--device" not in _build_groups(plan.args, [plan], {})["executor"][0].argv  # the executor's auto


def test_a_second_hosts_ranks_take_its_gpus_from_the_first():
    """``--nnodes 2``: host 1 runs ranks 2 and 3, which are GPUs 0 and 1 of that host."""
    plans = _plans("-tp", "4", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "127.0.0.1:29500")
    groups = _build_groups(plans[0].args, plans, {})
    assert [(c.rank, _flag(c.argv, "--device-index")) for c in groups["executor"]] == [(2, "0"), (3, "1")]


def test_the_executor_takes_its_gpu_place():
    from services.executor.main import ExecutorConfig
    from shared.endpoints import Endpoints

    endpoints = Endpoints(request="", step="ipc:///tmp/s", result="ipc:///tmp/r")
    assert ExecutorConfig(endpoints=endpoints, device_index=3).device_index == 3
    with pytest.raises(ValueError, match="--device-index must be >= 0"):
        ExecutorConfig(endpoints=endpoints, device_index=-1)
    args = build_parser().parse_args(["executor", "--device", "cuda:1", "--device-index", "2"])
    assert (args.device, args.device_index) == ("cuda:1", 2)
