"""The launcher's restart counts handed to the frontend in a file (``shared.restart_counts``): the
launcher's count wins for each process it supervises, the observed one stands for the others; /health
reports the counts it is given (those /metrics reports)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from services.frontend.health_report import health_report
from shared.messages import EngineStats, ExecutorHealth
from shared.restart_counts import read_restart_counts, supervised_or_observed, write_restart_counts


def test_the_launchers_counts_win_for_the_processes_it_supervises(tmp_path):
    path = str(tmp_path / "restarts.json")
    observed = {"executor": 2, "scheduler": 0, "frontend": 5}
    assert supervised_or_observed(observed, None) == observed  # no launcher
    assert read_restart_counts(path) is None and supervised_or_observed(observed, path) == observed  # no file
    write_restart_counts(path, {"executor": 3, "scheduler": 1, "frontend": 0})
    assert read_restart_counts(path) == {"executor": 3, "scheduler": 1, "frontend": 0}
    assert supervised_or_observed(observed, path) == {"executor": 3, "scheduler": 1, "frontend": 0}
    write_restart_counts(path, {"executor": 4})  # a host without the scheduler supervises its ranks only
    assert supervised_or_observed(observed, path) == {"executor": 4, "scheduler": 0, "frontend": 5}
    assert os.listdir(tmp_path) == ["restarts.json"]  # replaced whole: nothing half-written left
    (tmp_path / "restarts.json").write_text('{"executor": ')
    assert read_restart_counts(path) is None and supervised_or_observed(observed, path) == observed


def test_health_reports_the_counts_it_is_given_each_executor_rank_the_groups():
    """Not what the scheduler saw (the rank at fault, under this scheduler): the ranks restart
    together, so each reports the group's count, as /metrics' ``process="executor"``."""
    stats = EngineStats(0, 0, 10, 0, 0, 0, True, epoch=2, pid=4, world_size=2,
                        executors=[ExecutorHealth(0, 5, "ok", 0.1, 0), ExecutorHealth(1, 6, "ok", 0.1, 1)])
    client = SimpleNamespace(latest_stats=stats, scheduler_lost=False, scheduler_silence_s=lambda: 0.2)
    status, body = health_report(client, {"executor": 3, "scheduler": 1, "frontend": 2})
    assert status == 200 and body["processes"]["scheduler"]["num_restarts"] == 1
    assert [e["num_restarts"] for e in body["processes"]["executors"]] == [3, 3]
    assert body["processes"]["frontend"]["num_restarts"] == 2
