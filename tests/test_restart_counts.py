"""The launcher's restart counts handed to the frontend in a file (``shared.restart_counts``): the
launcher's count wins for each process it supervises, the observed one stands for the others."""

from __future__ import annotations

import os

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
