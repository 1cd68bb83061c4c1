"""How serve lays out an executor group (no processes), how the scheduler and the frontend report
it, and the flag errors serve gives before it starts anything."""

import pytest

from services.cli import build_parser, main
from services.frontend.metrics import FrontendMetrics
from services.group_layout import layout_from_args
from services.scheduler.liveness import group_stats
from shared.messages import EngineStats, ExecutorReady


def _layout(*flags: str):
    return layout_from_args(build_parser().parse_args(["serve", *flags]), "/run/psv")


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_rank_adds_nothing():
    layout = _layout()
    assert list(layout.local_ranks) == [0] and layout.runs_scheduler
    assert layout.executor_argv(0, None) == [] and layout.scheduler_argv() == []


def test_ranks_on_one_host_share_the_group_and_the_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    layout = _layout("-tp", "3")
    argv = [layout.executor_argv(rank, None) for rank in layout.local_ranks]
    assert [_flag(a, "--rank") for a in argv] == ["0", "1", "2"]
    for a in argv:
        assert _flag(a, "--world-size") == "3" and _flag(a, "--all-reduce") == "auto"
        assert _flag(a, "--group-id") == layout.group_id and _flag(a, "--group-store") == "/run/psv/group-store"
        assert _flag(a, "--num-threads") == "2"  # 8 cores // 3 ranks
        assert "--step-endpoint" not in a  # the private directory's ipc:// endpoints
    assert "--num-threads" not in layout.executor_argv(0, 4)  # --num-threads given: the launcher passes it
    assert layout.scheduler_argv() == ["--world-size", "3"]
    assert _layout("-tp", "3").group_id != layout.group_id


def test_torch_on_one_host_gets_a_local_rendezvous():
    layout = _layout("-tp", "2", "--all-reduce", "torch")
    host, port = layout.dist_init_addr.split(":")
    assert host == "127.0.0.1" and int(port) > 0
    assert _flag(layout.executor_argv(1, None), "--dist-init-addr") == layout.dist_init_addr


def test_two_hosts_split_the_ranks_and_meet_over_tcp():
    flags = ["-tp", "4", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:29500"]
    first, second = _layout(*flags), _layout(*flags, "--node-rank", "1")
    assert (list(first.local_ranks), list(second.local_ranks)) == ([0, 1], [2, 3])
    assert first.runs_scheduler and not second.runs_scheduler
    assert first.scheduler_argv() == ["--world-size", "4", "--step-endpoint", "tcp://127.0.0.1:29501",
                                      "--result-endpoint", "tcp://127.0.0.1:29502"]
    argv = second.executor_argv(3, None)
    assert _flag(argv, "--rank") == "3" and _flag(argv, "--nnodes") == "2"
    assert _flag(argv, "--step-endpoint") == "tcp://127.0.0.1:29501"
    assert _flag(argv, "--result-endpoint") == "tcp://127.0.0.1:29502"


@pytest.mark.parametrize("flags,message", [
    (["-tp", "0"], "-tp/--tensor-parallel-size must be at least 1, got 0"),
    (["-tp", "4", "--nnodes", "3"], "--nnodes 3 must divide --tensor-parallel-size 4"),
    (["-tp", "4", "--nnodes", "2"], "needs --dist-init-addr HOST:PORT"),
    (["-tp", "2", "--nnodes", "2", "--node-rank", "2"], "--node-rank 2 must be in [0, --nnodes 2)"),
    (["-tp", "2", "--nnodes", "2", "--dist-init-addr", "nowhere"], "--dist-init-addr must be HOST:PORT"),
    (["-tp", "4", "--nnodes", "2", "--all-reduce", "shm", "--dist-init-addr", "h:1"], "works on one host"),
])
def test_bad_group_flags_exit_2_before_starting(flags, message, capsys):
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedserve serve: ") and message in err and err.count("\n") == 1


def test_heads_that_do_not_split_exit_2_before_starting(tmp_path, capsys):
    from tests.doubles.engine import tiny_llama

    tiny_llama(num_attention_heads=6, num_key_value_heads=2, hidden_size=96).save_pretrained(tmp_path)
    capsys.readouterr()
    assert main(["serve", "--model", str(tmp_path), "-tp", "4"]) == 2
    assert capsys.readouterr().err == ("pagedserve serve: --tensor-parallel-size 4 must divide the number of "
                                       "attention heads (6)\n")
    assert main(["serve", "--model", str(tmp_path), "-tp", "3"]) == 2
    assert "--tensor-parallel-size 3 and the 2 KV heads: one must divide the other" in capsys.readouterr().err


def test_scheduler_reports_the_group_from_every_rank():
    ready = {r: ExecutorReady(r, 2, 100 + r, 16, 256, all_reduce="shm", kv_cache_bytes=2**20 + r,
                              kv_cache_dtype="int8") for r in (1, 0)}
    assert group_stats(ready, 2) == {"world_size": 2, "all_reduce": "shm", "num_kv_blocks_per_rank": [100, 101],
                                     "kv_cache_bytes_per_rank": [2**20, 2**20 + 1], "kv_cache_dtype": "int8",
                                     "kv_block_size": 16}
    with pytest.raises(ValueError, match="executor rank 0 reports --world-size 2; the scheduler has --world-size 3"):
        group_stats(ready, 3)
    ready[1] = ExecutorReady(1, 2, 100, 32, 256)
    with pytest.raises(ValueError, match="executor rank 1 has --block-size 32, rank 0 16"):
        group_stats(ready, 2)


def test_metrics_report_the_group():
    stats = EngineStats(0, 0, 100, 0, 0, 0, True, world_size=2, all_reduce="torch",
                        num_kv_blocks_per_rank=[100, 90], kv_cache_bytes_per_rank=[4096, 4000])
    text = FrontendMetrics(lambda: stats).render().decode()
    for line in ('pagedserve:tensor_parallel_size 2.0', 'pagedserve:all_reduce_info{kind="torch"} 1.0',
                 'pagedserve:kv_blocks_per_rank{rank="1"} 90.0', 'pagedserve:kv_cache_bytes_per_rank{rank="0"} 4096.0'):
        assert line in text.splitlines()
    assert "pagedserve:tensor_parallel_size 0.0" in FrontendMetrics(lambda: None).render().decode()


@pytest.mark.parametrize("flag", ["--async-scheduling", "--no-async-scheduling", None])
@pytest.mark.parametrize("threads_flag", ["--adaptive-threads", "--no-adaptive-threads", None])
def test_serve_passes_each_switch_on_as_given(flag, threads_flag):
    from services.launcher import executor_argv, scheduler_argv

    args = build_parser().parse_args(["serve", "--num-threads", "2", *filter(None, [flag, threads_flag])])
    scheduler, executor = scheduler_argv(args), executor_argv(args)
    assert [a for a in scheduler if "async" in a] == ([flag] if flag else [])
    assert [a for a in executor if "adaptive" in a] == ([threads_flag] if threads_flag else [])
    assert "True" not in scheduler + executor and "False" not in scheduler + executor
    assert executor[executor.index("--num-threads") + 1] == "2"
    parsed = build_parser().parse_args(["executor", *executor])  # the executor takes what it is given
    assert parsed.adaptive_threads == (None if threads_flag is None else threads_flag == "--adaptive-threads")


def test_serve_passes_plan_ahead_at_to_the_scheduler():
    from services.launcher import scheduler_argv

    assert "--plan-ahead-at" not in scheduler_argv(build_parser().parse_args(["serve"]))
    argv = scheduler_argv(build_parser().parse_args(["serve", "--plan-ahead-at", "0"]))
    assert argv[argv.index("--plan-ahead-at") + 1] == "0.0"
    assert build_parser().parse_args(["scheduler", *argv]).plan_ahead_at == 0.0


def _rank(running: bool, followed: bool = False):
    from types import SimpleNamespace
    return SimpleNamespace(running=running, followed=followed)


def test_the_rank_that_failed_first_is_named_not_one_that_stopped_for_it():
    """A rank that stopped because another failed (``followed``) is named only when no other
    ended; while the others still run and the grace is not over, the launcher waits to see the
    rank that failed first (a killed rank may be reaped after its peers noticed it)."""
    from services.launcher import first_ended

    follower, killed, alive = _rank(False, followed=True), _rank(False), _rank(True)
    assert first_ended([alive, follower, killed]) is killed
    assert first_ended([alive, follower, killed], grace_over=False) is killed
    assert first_ended([alive, follower, _rank(True)], grace_over=False) is None  # not reaped yet
    assert first_ended([alive, follower, _rank(True)]) is follower  # the grace is over
    assert first_ended([follower, _rank(False, followed=True)], grace_over=False) is follower  # all ended
    assert first_ended([alive, _rank(True)], grace_over=False) is None
