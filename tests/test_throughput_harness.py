"""``loadtest.throughput``'s order of work: each server gets the same warm-up requests before it is
measured, and both are measured on the same workload (the network parts replaced here)."""

from __future__ import annotations

import sys

import pytest

from loadtest import throughput


@pytest.fixture()
def sent(monkeypatch):
    """(label, requests) of every ``run_server`` call, in order; every request 'returns' at once."""
    calls = []

    async def run_server(url, model, reqs, label="pagedserve"):
        calls.append((label, url, reqs))
        return [throughput.Result(0.1, 1.0, r.max_tokens) for r in reqs], 1.0

    monkeypatch.setattr(throughput, "run_server", run_server)
    monkeypatch.setattr(throughput, "_get_json", lambda url: {"status": "ok"})
    monkeypatch.setattr(throughput, "peer_model_name", lambda url: "peer-model")
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
