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


def test_html_replay_records_every_step_of_both_policies(tmp_path):
    import json
    import re

    from services.replay_page import render_page, replay_data

    reqs = parse_requests(DEFAULT_REQUESTS)
    data = replay_data(reqs, 256, 8, 64)
    for policy, run in data["runs"].items():
        frames = run["frames"]
        assert len(frames) == run["summary"]["steps"] + 1  # before the first step, then after each
        assert frames[0]["snapshot"]["sequences"] == [] and frames[0]["finished"] == []
        assert len(frames[-1]["finished"]) == len(reqs) and frames[-1]["snapshot"]["stats"]["num_blocks_used"] == 0
        most = max(len(f["snapshot"]["sequences"]) for f in frames)
        assert most == run["summary"]["max_running"]
    # Contiguous: every request holds one unbroken run of 64 / 8 blocks; paged: blocks as it grows.
    for frame in data["runs"]["contiguous"]["frames"]:
        for seq in frame["snapshot"]["sequences"]:
            table = seq["block_table"]
            assert table == list(range(table[0], table[0] + 8))
    paged_tables = [s["block_table"] for f in data["runs"]["paged"]["frames"] for s in f["snapshot"]["sequences"]]
    assert min(len(t) for t in paged_tables) == 1 and max(len(t) for t in paged_tables) <= 8
    page = render_page(data)
    assert "/*" + "KVMAP*/" not in page and "/*" + "KVDRAW*/" not in page
    assert "class KvMap" in page and "function drawCell" in page and "KvTable" in page and "window.replay" in page
    embedded = re.search(r'<script type="application/json" id="replay-data">(.*?)</script>', page, re.S).group(1)
    assert json.loads(embedded) == json.loads(json.dumps(data))
    assert "src=" not in page and "href=" not in page  # nothing to fetch: it opens from disk


def test_cli_writes_the_html_replay(tmp_path):
    path = tmp_path / "replay.html"
    out = subprocess.run([sys.executable, "-m", "services.cli", "simulate", "--html", str(path)], capture_output=True,
                         text=True, check=True).stdout
    assert str(path) in out and path.read_text().startswith("<!doctype html>")
