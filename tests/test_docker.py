"""The compose deployment on a real Docker engine (``deploy/smoke.py``, which ``deploy/smoke.sh`` runs).

Runs whenever a Docker daemon is reachable and the image exists or can be built: builds the image
offline, ``compose up -d``, waits for three healthy services, streams "Paris" through the openai
client, kills the executor twice (``docker kill``, then a crash inside the container), and
``compose down``. Skipped with the reason otherwise (no docker client, no daemon, no compose, no
image and no way to make one); without a docker client the skip costs nothing.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(3600)]

IMAGE = os.environ.get("PAGEDSERVE_IMAGE", "pagedserve:cpu")


@pytest.fixture(scope="module")
def report():
    from deploy.smoke import run_smoke, why_not_runnable

    why = why_not_runnable(IMAGE)
    if why:
        pytest.skip(f"the docker deployment test needs a Docker engine: {why}")
    return run_smoke(IMAGE)


def _passed(report, name: str) -> None:
    passed, detail = report.checks.get(name, (False, "step not reached"))
    assert passed, f"{name}: {detail}; notes: {report.notes}"


def test_offline_image_serves_through_compose(report):
    for name in ("image builds offline", "deployment steps"):  # recorded only when they fail
        passed, detail = report.checks.get(name, (True, ""))
        assert passed, f"{name}: {detail}; notes: {report.notes}"
    assert report.image_size and "build" in report.times_s and "up to healthy" in report.times_s
    _passed(report, "first answer")
    _passed(report, "compose down leaves nothing")


def test_restart_policy_brings_back_a_crashed_executor(report):
    _passed(report, "restart policy restarts a crashed executor")
    assert "recovery after crash (restart policy)" in report.times_s


def test_answers_after_the_executor_restarts_are_right(report):
    """The scheduler sees the restarted executor's new process (its heartbeat), empties its prefix
    cache and starts every sequence over on the new, empty KV pool (issue 11)."""
    _passed(report, "answer after docker kill + compose up -d")
    _passed(report, "answer after executor crash + restart")
