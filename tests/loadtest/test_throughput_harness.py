"""``loadtest.bench.throughput``'s order of work: each server gets the same warm-up requests before it is
measured, and both are measured on the same workload (the network parts replaced here)."""

from __future__ import annotations

import sys

import pytest

from loadtest.bench import throughput


@pytest.fixture()
def sent(monkeypatch):
    """(label, requests) of every ``run_server`` call, in order; every request 'returns' at once."""
    calls = []

    async def run_server(url, model, reqs, label="pagedserve"):
        calls.append((label, url, reqs))
        return [throughput.Result(0.1, 1.0, r.max_tokens) for r in reqs], 1.0

    monkeypatch.setattr(throughput, "run_server", run_server)
    monkeypatch.setattr(throughput, "_get_json", lambda url: {"status": "ok"})
    monkeypatch.setattr(throughput, "served_model_name", lambda url: "served-model")
    monkeypatch.setattr(throughput, "wait_for_quiet", lambda: 0.0)  # tested on its own below
    return calls


def _main(monkeypatch, *flags):
    monkeypatch.setattr(sys, "argv", ["throughput", "--url", "http://ours", "--peer-url", "http://peer",
                                      "--skip-hf", "--num-requests", "12", *flags])
    throughput.main()


def test_both_servers_get_the_same_warm_up_before_the_workload(sent, monkeypatch, capsys):
    _main(monkeypatch)
    labels = [label for label, _, _ in sent]
    assert labels == ["pagedserve warm-up", "pagedserve", "peer warm-up", "peer"]
    (_, u1, warm1), (_, u2, work1), (_, u3, warm2), (_, u4, work2) = sent
    assert (u1, u2, u3, u4) == ("http://ours", "http://ours", "http://peer", "http://peer")
    assert warm1 == warm2 and work1 == work2 and len(warm1) == len(work1) == 12
    assert all(r.max_tokens == throughput.WARMUP_OUTPUT_TOKENS for r in warm1)
    # other prompts than the workload's (a seed far from it), within the same length range
    assert [r.prompt_ids for r in warm1] != [r.prompt_ids for r in work1]
    assert all(16 <= len(r.prompt_ids) <= 256 for r in warm1)
    assert "throughput pagedserve / peer: 1.00x" in capsys.readouterr().out


def test_no_warm_up_when_asked(sent, monkeypatch):
    _main(monkeypatch, "--warmup", "0")
    assert [label for label, _, _ in sent] == ["pagedserve", "peer"]


def test_rounds_alternate_the_order_on_fresh_workloads(sent, monkeypatch, capsys):
    _main(monkeypatch, "--rounds", "3")
    labels = [label for label, _, _ in sent]
    # each server warmed once, right before its first run; then ABBA: ours first in even rounds
    assert labels == ["pagedserve warm-up", "pagedserve", "peer warm-up", "peer",
                      "peer", "pagedserve", "pagedserve", "peer"]
    runs = [(label, reqs) for label, _, reqs in sent if "warm-up" not in label]
    round1, round2, round3 = runs[0:2], runs[2:4], runs[4:6]
    for (_, a), (_, b) in (round1, round2, round3):
        assert a == b  # both servers get the round's requests
    prompts = [[r.prompt_ids for r in rnd[0][1]] for rnd in (round1, round2, round3)]
    assert prompts[0] != prompts[1] != prompts[2] != prompts[0]  # every round its own seed
    out = capsys.readouterr().out
    assert out.count("round ") >= 3 and "medians of 3 rounds" in out
    assert "per round, throughput pagedserve / peer: 1.00x 1.00x 1.00x (median 1.00x)" in out


def test_round_one_is_the_single_run_workload(sent, monkeypatch):
    _main(monkeypatch, "--seed", "7")
    single = [reqs for label, _, reqs in sent if label == "pagedserve"]
    sent.clear()
    _main(monkeypatch, "--seed", "7", "--rounds", "2")
    first = [reqs for label, _, reqs in sent if label == "pagedserve"][0]
    assert single == [first]


def test_medians_and_ratios_per_round(capsys):
    rounds = [{"a": {"output tokens/s": 300.0, "median TTFT (s)": 2.0},
               "b": {"output tokens/s": 200.0, "median TTFT (s)": 4.0}},
              {"a": {"output tokens/s": 330.0, "median TTFT (s)": 3.0},
               "b": {"output tokens/s": 300.0, "median TTFT (s)": 2.0}},
              {"a": {"output tokens/s": 400.0, "median TTFT (s)": 1.0},
               "b": {"output tokens/s": 250.0, "median TTFT (s)": 2.0}}]
    assert throughput.median_summary([r["a"] for r in rounds]) == {"output tokens/s": 330.0, "median TTFT (s)": 2.0}
    throughput.print_round_ratios(rounds, "a", "b")
    out = capsys.readouterr().out
    assert "throughput a / b: 1.50x 1.10x 1.60x (median 1.50x)" in out
    assert "median TTFT a / b: 0.50x 1.50x 0.50x (median 0.50x)" in out


def test_every_measured_run_waits_for_quiet(sent, monkeypatch):
    waits = []
    monkeypatch.setattr(throughput, "wait_for_quiet", lambda: waits.append(len(sent)) or 0.0)
    _main(monkeypatch, "--rounds", "2")
    # before each of the four measured runs: after 1 call (ours' warm-up), 3, 4 and 5
    assert waits == [1, 3, 4, 5]


def test_hugging_face_row_runs_the_first_rounds_requests(sent, monkeypatch, capsys):
    seen = []

    def run_hf_static(reqs, batch_size, threads):
        seen.append(reqs)
        return [throughput.Result(0.2, 2.0, r.max_tokens) for r in reqs], 2.0, 0.5

    monkeypatch.setattr(throughput, "run_hf_static", run_hf_static)
    monkeypatch.setattr(sys, "argv", ["throughput", "--url", "http://ours", "--peer-url", "http://peer",
                                      "--num-requests", "12", "--rounds", "2"])
    throughput.main()
    first_round = [reqs for label, _, reqs in sent if label == "pagedserve"][0]
    assert seen == [first_round]
    out = capsys.readouterr().out
    assert "HF static (16)" in out and "CPU steal (%)" in out
