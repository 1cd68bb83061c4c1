"""``pagedserve simulate``: the block manager alone under both KV policies."""

import subprocess
import sys

import pytest

from services.scheduler.simulate import DEFAULT_REQUESTS, parse_requests, simulate, worked_example


def test_paged_beats_contiguous_on_the_seed_workload():
    reqs = parse_requests(DEFAULT_REQUESTS)
    contiguous = simulate(reqs, 256, 8, 64, "contiguous")
    paged = simulate(reqs, 256, 8, 64, "paged")
    assert contiguous["max_running"] == 4  # 256 slots / 64-slot reservations
    assert paged["max_running"] == 10
    assert paged["steps"] < contiguous["steps"]
    assert paged["mean_utilization"] > 0.8 > 0.45 > contiguous["mean_utilization"]
    # Every request runs prefill (1 step, first token) plus answer - 1 decodes: the longest is 40.
    assert paged["steps"] >= max(a for _, a in reqs)


def test_paged_preempts_and_still_finishes_in_a_tight_pool():
    reqs = parse_requests("20:40,20:40,20:40,20:40")
    r = simulate(reqs, 160, 8, 64, "paged")
    assert r["preemptions"] > 0 and r["steps"] > 40


def test_worked_example_numbers():
    text = worked_example()
    assert "1748 slots wasted (85% of the reservation)" in text
    assert "19 pages (304 slots), 4 slots wasted" in text


def test_bad_request_spec_is_a_clear_error():
    with pytest.raises(ValueError, match="PROMPT:ANSWER"):
        parse_requests("10-20")
    with pytest.raises(ValueError, match="exceed --max-model-len 64"):
        simulate([(40, 30)], 256, 8, 64, "paged")


def test_cli_prints_both_policies():
    out = subprocess.run([sys.executable, "-m", "services.cli", "simulate"], capture_output=True, text=True,
                         check=True).stdout
    assert "contiguous" in out and "paged" in out and "19 pages" in out
