"""The Locust load test (``loadtest/locustfile.py``), headless for a few seconds against the tiny-model
server: its CSV has TTFT, ITL and E2E rows with counts, and no failure; its HTML report is written.
Also the pieces it is made of: the length distributions and the SSE timing reader."""

from __future__ import annotations

import csv
import json
import os
import random
import re
import subprocess
import sys
import urllib.request

import pytest

from loadtest.common.stream_timing import read_stream
from loadtest.common.workloads import CHAT_OVERHEAD_TOKENS, DATASETS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name, mean_input, mean_output", [("sharegpt", 161.31, 337.99), ("alpaca", 19.31, 58.45)])
def test_lengths_have_the_papers_means_and_fit_the_context(name, mean_input, mean_output):
    rng = random.Random(0)
    pairs = [DATASETS[name].sample(rng, max_model_len=100_000) for _ in range(20_000)]
    assert sum(i for i, _ in pairs) / len(pairs) == pytest.approx(mean_input, rel=0.05)
    assert sum(o for _, o in pairs) / len(pairs) == pytest.approx(mean_output, rel=0.05)
    clipped = [DATASETS[name].sample(rng, max_model_len=256) for _ in range(2_000)]
    assert all(i >= 1 and o >= 1 and i + o + CHAT_OVERHEAD_TOKENS <= 256 for i, o in clipped)


def test_stream_timings_from_server_sent_events():
    clock = iter([1.5, 1.75, 2.5, 3.0]).__next__
    lines = [
        b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}', b"",
        b'data: {"choices": [{"delta": {"content": "Par"}}]}', b"",
        b'data: {"choices": [{"delta": {"content": "is"}}]}', b"",
        b'data: {"choices": [{"delta": {"content": "."}}]}', b"",
        b'data: {"choices": [], "usage": {"completion_tokens": 3}}', b"",
        b"data: [DONE]",
    ]
    times = read_stream(lines, start_s=1.0, clock=clock)
    assert times.ttft_s == 0.5 and times.itls_s == [0.25, 0.75] and times.e2e_s == 2.0
    assert times.problem(3) is None
    assert times.problem(4) == "3 output tokens, expected 4 (ignore_eos)"
    cut = read_stream(lines[:4], start_s=1.0, clock=iter([1.5]).__next__)
    assert cut.problem() == "the stream ended without data: [DONE]"
    error = read_stream([b'data: {"error": {"message": "engine failed"}}'], start_s=0.0)
    assert error.problem() == "error event: engine failed"


@pytest.fixture(scope="module")
def server(tiny_f32_server):
    """The session's float32 tiny-model server (conftest.py, shared with test_offline and
    test_server_frontends: a start fewer; served as ``tiny`` with the model's whole 256-token
    context); a stream Locust would cut at its stop timeout is aborted by the server as any client's is."""
    url = tiny_f32_server[0]
    _warm_up(url)  # the kernels compile on first use: not inside Locust's few seconds
    return url


def _warm_up(url: str) -> None:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "the city"}], "max_tokens": 4,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.status == 200


@pytest.mark.slow
def test_locust_headless_reports_ttft_and_inter_token_latency(server, tmp_path):
    # Four seconds of arrivals, then (--stop-timeout) every stream in flight runs to its end: on a
    # busy machine none may have ended within the four seconds, and the test is about the reports,
    # not about how many streams fit in a given time. Such runs (CI with three test workers on two
    # cores) had only the users' GET /v1/models in the CSV until the locustfile made Locust write
    # its CSV once more at exit.
    out = str(tmp_path / "out")
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "4", "-r", "4",
         "-t", "4s", "-s", "120", "--host", server, "--dataset", "alpaca", "--csv", out, "--html", f"{out}.html",
         "--only-summary", "--loglevel", "WARNING"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(f"{out}_stats.csv", newline="") as f:
        rows = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    summary = proc.stdout + proc.stderr
    for kind in ("TTFT", "ITL", "E2E"):
        assert (kind, "alpaca") in rows, (list(rows), summary[-3000:])
        assert int(rows[(kind, "alpaca")]["Request Count"]) > 0
        assert int(rows[(kind, "alpaca")]["Failure Count"]) == 0
        # The CSV has the final figures, those of the printed summary, with the streams that ended
        # during --stop-timeout (Locust alone writes its CSV a tick before the end: locustfile.py).
        printed = re.search(rf"^{kind}\s+alpaca\s+(\d+)\s", summary, re.MULTILINE)
        assert printed and int(printed.group(1)) == int(rows[(kind, "alpaca")]["Request Count"]), summary[-3000:]
    requests = rows[("POST", "chat [alpaca]")]
    assert int(requests["Request Count"]) >= int(rows[("E2E", "alpaca")]["Request Count"]) > 0
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0
    # E2E's size column is the output tokens: Alpaca's outputs are tens of tokens.
    assert float(rows[("E2E", "alpaca")]["Average Content Size"]) > 1
    assert os.path.getsize(f"{out}.html") > 0
