"""Executor liveness as the scheduler judges it (``ExecutorGroup``), and how often the supervisor
may restart a process (``RestartBudget``): plain classes, times passed in."""

from __future__ import annotations

import pytest

from services.restart_budget import RestartBudget
from services.scheduler.liveness import ExecutorGroup, Loss, ShapeMismatch
from shared.messages import ExecutorReady, Heartbeat

EPOCH = 77


def _ready(rank=0, incarnation=1, epoch=EPOCH, num_blocks=100, world_size=1, pid=None) -> ExecutorReady:
    return ExecutorReady(rank, world_size, num_blocks, 16, 256, 8, model="tiny", incarnation=incarnation,
                         pid=pid or 1000 + incarnation, epoch=epoch)


def _group(world_size=1) -> ExecutorGroup:
    return ExecutorGroup(world_size, heartbeat_timeout_s=3.0, step_timeout_s=5.0)


def test_a_rank_is_accepted_when_it_answers_this_epoch():
    group = _group()
    assert group.on_ready(_ready(epoch=0), EPOCH, 0.0) is None  # sent unasked after loading
    assert not group.ready and group.health(0.5)[0].status == "starting"
    assert group.on_ready(_ready(), EPOCH, 1.0) is None
    assert group.ready and group.shape.num_blocks == 100
    [health] = group.health(1.5)
    assert (health.status, health.pid, health.seconds_since_heartbeat, health.num_restarts) == ("ok", 1001, 0.5, 0)


def test_silence_and_overdue_steps_are_losses():
    group = _group()
    group.on_ready(_ready(), EPOCH, 0.0)
    group.on_heartbeat(Heartbeat(0, 1, 1001), 2.0)
    assert group.check(4.9) is None
    loss = group.check(5.1)
    assert loss.rank == 0 and "no heartbeat from rank 0 (pid 1001) for 3.1 s (--heartbeat-timeout 3)" in loss.cause
    group.on_heartbeat(Heartbeat(0, 1, 1001), 5.1)
    group.step_sent(5.2)
    group.on_heartbeat(Heartbeat(0, 1, 1001), 8.0)
    assert group.check(10.0) is None
    group.on_heartbeat(Heartbeat(0, 1, 1001), 10.3)
    assert "no result 5.1 s after it went out (--step-timeout 5)" in group.check(10.3).cause
    group.step_done(10.3)
    assert group.check(10.3) is None


def test_a_new_process_of_an_accepted_rank_is_a_loss_and_the_old_one_is_never_taken_back():
    group = _group()
    group.on_ready(_ready(incarnation=1), EPOCH, 0.0)
    loss = group.on_heartbeat(Heartbeat(0, 2, 1002), 1.0)  # a new process beats before it loads
    assert "rank 0 was restarted: a new process (pid 1002) replaced pid 1001" in loss.cause
    assert group.lose(loss) == [(0, 1001)]
    assert not group.ready and group.health(1.0)[0].status == "lost"
    assert group.on_heartbeat(Heartbeat(0, 1, 1001), 1.5) is None  # the lost one, still talking: ignored
    assert group.on_ready(_ready(incarnation=1), EPOCH, 2.0) is None and not group.ready
    group.on_heartbeat(Heartbeat(0, 2, 1002), 2.5)
    assert group.health(2.5)[0].pid == 1002
    assert group.on_ready(_ready(incarnation=2), EPOCH, 3.0) is None and group.ready
    assert group.health(3.0)[0].num_restarts == 1
    assert "replaced" in group.on_ready(_ready(incarnation=3, epoch=0), EPOCH, 4.0).cause


def test_losing_one_rank_replaces_the_whole_group():
    group = _group(world_size=2)
    group.on_ready(_ready(rank=0, incarnation=1, world_size=2), EPOCH, 0.0)
    assert not group.ready and group.stats == {"world_size": 2}
    group.on_ready(_ready(rank=1, incarnation=2, world_size=2, num_blocks=90), EPOCH, 0.0)
    assert group.ready and group.shape.num_blocks == 90  # the smallest rank's pool
    assert group.stats["world_size"] == 2 and group.stats["num_kv_blocks_per_rank"] == [100, 90]
    assert group.last_retired == []
    loss = group.check(10.0)
    assert group.lose(loss) == [(0, 1001), (1, 1002)]
    assert group.last_retired == [1, 2]  # Hello names both processes: one still running exits
    group.on_ready(_ready(rank=0, incarnation=3, world_size=2), EPOCH, 11.0)
    assert not group.ready  # rank 1 must come back too
    group.on_ready(_ready(rank=1, incarnation=4, world_size=2, num_blocks=90), EPOCH, 11.0)
    assert group.ready
    assert group.on_ready(_ready(rank=5, incarnation=9), EPOCH, 12.0) is None  # no such rank
    for incarnation in range(5, 12, 2):  # four more groups lost: Hello names the last four groups'
        group.lose(Loss(0, "test"))
        group.on_ready(_ready(rank=0, incarnation=incarnation, world_size=2), EPOCH, 13.0)
        group.on_ready(_ready(rank=1, incarnation=incarnation + 1, world_size=2, num_blocks=90), EPOCH, 13.0)
    assert group.last_retired == list(range(3, 11))


def test_a_rank_of_another_group_size_stops_the_scheduler():
    group = _group(world_size=2)
    group.on_ready(_ready(rank=0, incarnation=1, world_size=2), EPOCH, 0.0)
    with pytest.raises(ValueError, match="executor rank 1 reports --world-size 3; the scheduler has --world-size 2"):
        group.on_ready(_ready(rank=1, incarnation=2, world_size=3), EPOCH, 0.0)


def test_a_restarted_group_must_have_the_first_pool_shape():
    group = _group()
    group.on_ready(_ready(incarnation=1), EPOCH, 0.0)
    group.lose(group.check(10.0))
    with pytest.raises(ShapeMismatch, match="num_blocks=90.*num_blocks=100"):
        group.on_ready(_ready(incarnation=2, num_blocks=90), EPOCH, 11.0)


def test_restart_budget_counts_within_its_window():
    budget = RestartBudget(max_restarts=2, window_s=60.0)
    assert budget.allow("executor", 0.0) and budget.allow("executor", 10.0)
    assert budget.allow("scheduler", 10.0)  # each process has its own budget
    assert not budget.allow("executor", 59.0)
    assert budget.refusal("executor") == ("the executor process failed 3 times within 60 s "
                                          "(--max-restarts 2, --restart-window-s 60)")
    assert budget.allow("executor", 60.0)  # the first restart left the window
    assert budget.num_restarts == {"executor": 3, "scheduler": 1}
    assert not RestartBudget(max_restarts=0).allow("frontend", 0.0)
    with pytest.raises(ValueError, match="--restart-window-s"):
        RestartBudget(window_s=0)


def test_a_stall_of_the_scheduler_is_not_the_ranks_silence():
    group = _group()
    group.on_ready(_ready(), EPOCH, 0.0)
    group.step_sent(1.0)
    group.excuse(20.0)  # the scheduler was stopped for 20 s; nothing was read meanwhile
    assert group.check(21.5) is None
    assert "no heartbeat" in group.check(23.5).cause


def test_with_two_steps_out_the_second_ones_clock_starts_at_the_first_ones_result():
    group = _group()  # --step-timeout 5
    group.on_ready(_ready(), EPOCH, 0.0)
    group.step_sent(1.0)
    group.step_sent(1.1)  # planned ahead: it runs once the first is done
    group.on_heartbeat(Heartbeat(0, 1, 1001), 5.0)
    group.step_done(5.0)  # the first took 4 s
    group.on_heartbeat(Heartbeat(0, 1, 1001), 9.5)
    assert group.check(9.5) is None  # the second has run 4.5 s, not 8.4
    assert "no result 5.5 s after it went out" in group.check(10.5).cause
    group.step_done(10.6)
    assert group.check(10.6) is None  # nothing out: no step clock runs
