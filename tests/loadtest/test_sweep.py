"""The rate sweep (``python -m loadtest.sweep``): its workload (scaled lengths, Poisson arrivals, the
same requests at every rate), the sustained-rate rule on synthetic curves, the per-rate summary on
synthetic records, and, against the tiny-model server, the whole sweep end to end (CSV rows, PNG
files, the printed ratio, a redraw from the CSV files)."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import subprocess
import sys

import pytest

from loadtest.sweep.capacity import capacities, expected_ratio, memory_time
from loadtest.sweep.load import (HealthSample, RequestRecord, Workload, arrival_times_s, build_workload,
                                 max_tokens_for, prompt_ids, read_events)
from loadtest.sweep.report import sustained_rate, summarize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- sustained rate


def test_sustained_rate_is_the_last_rate_before_the_first_crossing():
    curve = [(0.5, 0.05), (1.0, 0.06), (2.0, 0.09), (3.0, 0.40), (4.0, 0.05)]  # a dip after the knee counts for nothing
    s = sustained_rate(curve, bound_s_per_token=0.25)
    assert s.rate_req_s == 2.0 and not s.beyond_sweep
    assert s.crossing_req_s == pytest.approx(2.0 + (0.25 - 0.09) / (0.40 - 0.09))  # linear between 2 and 3
    assert sustained_rate(list(reversed(curve)), 0.25) == s  # order of the points does not matter


def test_sustained_rate_edge_cases():
    never = sustained_rate([(1.0, 0.1), (2.0, 0.2)], bound_s_per_token=0.5)
    assert (never.rate_req_s, never.crossing_req_s, never.beyond_sweep, never.best_estimate) == (2.0, None, True, 2.0)
    first = sustained_rate([(1.0, 0.9), (2.0, 0.95)], bound_s_per_token=0.5)
    assert (first.rate_req_s, first.crossing_req_s, first.best_estimate) == (None, None, None)
    failed = sustained_rate([(1.0, 0.1), (2.0, math.inf)], bound_s_per_token=0.5)  # a failed run: no interpolation
    assert (failed.rate_req_s, failed.crossing_req_s) == (1.0, 1.0)
    assert sustained_rate([], 0.5).rate_req_s is None


# ---------------------------------------------------------------- workload


def test_workload_is_scaled_into_the_context_and_the_same_at_every_rate():
    w = build_workload("sharegpt", 4000, seed=3, max_model_len=2048, scale=0.25)
    assert w.max_model_len == 512 and len(w) == 4000
    assert all(p >= 1 and o >= 1 and p + o <= 512 for p, o in zip(w.num_prompt_tokens, w.num_output_tokens))
    # the paper's means (161 in / 338 out), scaled by 0.25
    assert sum(w.num_prompt_tokens) / len(w) == pytest.approx(161.31 * 0.25, rel=0.08)
    assert sum(w.num_output_tokens) / len(w) == pytest.approx(337.99 * 0.25, rel=0.08)
    assert build_workload("sharegpt", 4000, seed=3, max_model_len=2048, scale=0.25) == w  # seeded

    slow, fast = arrival_times_s(w, 4000, 0.5), arrival_times_s(w, 4000, 2.0)
    assert slow[0] == fast[0] == 0.0 and fast == pytest.approx([t / 4 for t in slow])
    assert slow[-1] / 3999 == pytest.approx(1 / 0.5, rel=0.08)  # mean gap of a Poisson process at 0.5 req/s

    a, b = prompt_ids(w, 50, 3, 1.0, 20), prompt_ids(w, 50, 3, 2.0, 20)
    assert [len(p) for p in a] == [len(p) for p in b] == w.num_prompt_tokens[:50]
    assert a != b  # fresh ids per rate: no prefix-cache hits carried over from the previous rate
    prefix = next(p for p in a if len(p) >= 20)[:20]
    assert all(p == prefix[:len(p)] for p in a + b if len(p) < 20)  # but the shared prefix is shared
    assert sum(p[:20] == prefix for p in a + b) == sum(len(p) >= 20 for p in a + b) > 10
    assert prompt_ids(w, 50, 3, 1.0, 20) == a


def test_reservations():
    assert max_tokens_for("exact", 40, 85, 512) == 85
    assert max_tokens_for("pow2", 40, 85, 512) == 128
    assert max_tokens_for("pow2", 40, 64, 512) == 64
    assert max_tokens_for("pow2", 400, 85, 512) == 112  # never past the context
    assert max_tokens_for("max", 40, 85, 512) == 472
    with pytest.raises(ValueError, match="oracle"):
        max_tokens_for("oracle", 40, 85, 512)


# ---------------------------------------------------------------- capacity model


def test_memory_time_of_one_request():
    # prompt 10, output 5, context 64, 16-token blocks: paged grows 11..15 tokens, all in one block
    assert memory_time("paged", "exact", 10, 5, 64, 16) == 5 * 16
    assert memory_time("contiguous", "exact", 10, 5, 64, 16) == 5 * 16  # Oracle: 15 tokens, one block
    assert memory_time("contiguous", "pow2", 10, 5, 64, 16) == 5 * 32  # 10 + 8 tokens: two blocks
    assert memory_time("contiguous", "max", 10, 5, 64, 16) == 5 * 64  # the whole context
    # paged pays for a block only once a token lands in it: 16, 16, 32, 32 slots over 4 steps
    assert memory_time("paged", "exact", 14, 4, 64, 16) == 16 + 16 + 32 + 32
    assert memory_time("contiguous", "exact", 14, 4, 64, 16) == 4 * 32


def test_capacity_replay_orders_the_policies():
    w = build_workload("sharegpt", 80, seed=1, max_model_len=2048, scale=0.125)  # a 256-token context
    ways = [("paged", "exact"), ("contiguous", "exact"), ("contiguous", "pow2"), ("contiguous", "max")]
    caps = capacities(w, ways, num_blocks=32, block_size=16, max_num_seqs=256)  # a pool of two contexts
    paged, oracle, pow2, whole = (caps[way] for way in ways)
    assert whole.mean_running == pytest.approx(2.0)  # two whole-context reservations, always
    assert paged.requests_per_step > oracle.requests_per_step > pow2.requests_per_step > whole.requests_per_step
    assert paged.mean_running > oracle.mean_running > pow2.mean_running > whole.mean_running
    assert paged.num_preemptions > 0 and oracle.num_preemptions == pow2.num_preemptions == whole.num_preemptions == 0
    assert paged.mean_memory_time < oracle.mean_memory_time < pow2.mean_memory_time < whole.mean_memory_time
    replayed, packed = expected_ratio(paged, oracle)
    assert replayed == pytest.approx(paged.requests_per_step / oracle.requests_per_step)
    assert packed == pytest.approx(oracle.mean_memory_time / paged.mean_memory_time) and packed > 1
    too_small = Workload([200], [50], [0.0], 256)
    with pytest.raises(ValueError, match="cannot run in 8 KV blocks"):
        capacities(too_small, [("contiguous", "max")], num_blocks=8, block_size=16, max_num_seqs=8)


# ---------------------------------------------------------------- reading a stream


class _FakeResponse:
    """The two things ``read_events`` uses: ``content`` (lines as they arrive) and ``close()``."""

    def __init__(self, chunks: list[dict | str]) -> None:
        self.lines = [f"data: {c if isinstance(c, str) else json.dumps(c)}\n".encode() for c in chunks]
        self.num_read, self.closed = 0, False

    @property
    def content(self):
        async def lines():
            for line in self.lines:
                self.num_read += 1
                yield line
                yield b"\n"
        return lines()

    def close(self) -> None:
        self.closed = True


def _chunk(*tokens: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": "".join(tokens), "finish_reason": finish,
                         "logprobs": {"tokens": list(tokens), "token_logprobs": [0.0] * len(tokens)}}]}


def _read_all(chunks, expected: int, client_stops: bool) -> tuple[RequestRecord, _FakeResponse]:
    record, resp = RequestRecord(0.0, expected, sent_s=0.0), _FakeResponse(chunks)
    clock = iter(range(1, 100)).__next__  # one tick per clock() call
    asyncio.run(read_events(resp, record, client_stops, lambda: float(clock())))
    return record, resp


def test_tokens_are_counted_from_logprobs_not_text():
    chunks = [_chunk("a"), _chunk("b", "c"), _chunk(), _chunk("d", finish="length"), "[DONE]"]
    record, resp = _read_all(chunks, 4, client_stops=False)
    assert record.ok and record.num_output_tokens == 4 and not resp.closed
    assert record.token_times_s == [1.0, 2.0, 2.0, 3.0] and record.first_token_s == 1.0 and record.done_s == 4.0
    short, _ = _read_all(chunks, 5, client_stops=False)
    assert short.error == "4 output tokens, expected 5"
    cut, _ = _read_all(chunks[:2], 3, client_stops=False)
    assert cut.error == "the stream ended without data: [DONE]"
    failed, _ = _read_all([_chunk("a"), {"error": {"message": "engine failed"}}], 3, client_stops=False)
    assert failed.error == "engine failed"


def test_the_client_closes_the_stream_at_the_drawn_length():
    chunks = [_chunk("a"), _chunk("b", "c", "d"), _chunk("e"), _chunk("f", finish="length"), "[DONE]"]
    record, resp = _read_all(chunks, 2, client_stops=True)  # "b" was the second token: "c" and "d" are dropped
    assert record.ok and record.num_output_tokens == 2 and record.done_s == record.token_times_s[-1] == 2.0
    assert resp.closed and resp.num_read == 2


# ---------------------------------------------------------------- summary


def _sample(t_s, running, used=None, allocated=None, blocks=0, preemptions=0):
    return HealthSample(t_s, running, 0, blocks, 10, used, allocated, preemptions)


def test_summary_of_synthetic_records():
    records = [RequestRecord(0.0, 10, sent_s=0.0, first_token_s=0.5, done_s=2.0, num_output_tokens=10,
                             token_times_s=[0.5 + 0.15 * k for k in range(10)]),  # 4 of them by 1.0 s
               RequestRecord(1.0, 4, sent_s=1.0, first_token_s=2.0, done_s=3.0, num_output_tokens=4,
                             token_times_s=[2.0, 2.3, 2.6, 3.0])]
    samples = [_sample(0.0, 0, preemptions=5), _sample(0.5, 2, 30, 64, blocks=4, preemptions=6),
               _sample(1.0, 1, 16, 32, blocks=2, preemptions=7), _sample(3.0, 0, preemptions=7)]
    s = summarize("paged", 1.0, records, samples)
    assert s.normalized_latency_s_per_token == pytest.approx((2.0 / 10 + 2.0 / 4) / 2)  # the paper's: per request
    assert (s.num_requests, s.num_completed, s.num_failed, s.duration_s) == (2, 2, 0, 3.0)
    assert s.throughput_req_s == pytest.approx(2 / 3) and s.throughput_output_tokens_s == pytest.approx(14 / 3)
    assert s.arriving_output_tokens_s == pytest.approx(4 / 1.0)  # requests arrived over [0, 1] s
    assert s.ttft_p50_s == pytest.approx(0.75) and s.ttft_p90_s == pytest.approx(0.95)
    assert (s.mean_running, s.max_running, s.num_preemptions) == (1.5, 2, 2)  # only samples with work count
    assert s.mean_kv_slot_utilization == pytest.approx((30 / 64 + 16 / 32) / 2)
    assert s.mean_kv_block_usage == pytest.approx((0.4 + 0.2) / 2)
    assert math.isnan(s.queued_output_tokens_s)  # nobody waited

    assert s.max_send_lag_s == 0.0 and math.isnan(s.load_avg_1m)

    unfinished = summarize("paged", 1.0, [*records, RequestRecord(2.0, 4, sent_s=2.25)], samples, load_avg_1m=2.5)
    # a request still running when --rate-timeout-s gave up: the rate is not sustained
    assert unfinished.num_failed == 1 and unfinished.normalized_latency_s_per_token == math.inf
    assert unfinished.max_send_lag_s == 0.25 and unfinished.load_avg_1m == 2.5
    records.append(RequestRecord(2.0, 4, sent_s=2.0, error="HTTP 503"))
    failed = summarize("paged", 1.0, records, samples)
    assert failed.num_failed == 1 and failed.normalized_latency_s_per_token == math.inf


def test_output_rate_while_requests_waited():
    tokens = [0.5 * k for k in range(21)]  # one token every 0.5 s over [0, 10] s
    records = [RequestRecord(0.0, 21, sent_s=0.0, first_token_s=0.0, done_s=10.0, num_output_tokens=21,
                             token_times_s=tokens)]
    waiting = [0, 3, 3, 0, 2, 0]  # requests waited over [2, 6) s and [8, 9) s
    samples = [HealthSample(t, 1, w, 4, 10, 16, 32, 0) for t, w in zip([0.0, 2.0, 4.0, 6.0, 8.0, 9.0], waiting)]
    s = summarize("paged", 1.0, records, samples)
    assert s.queued_output_tokens_s == pytest.approx((8 + 2) / 5.0)  # tokens at 2.0..5.5 and 8.0, 8.5
    brief = [HealthSample(0.0, 1, 1, 4, 10, 16, 32, 0), HealthSample(1.5, 1, 0, 4, 10, 16, 32, 0)]
    assert math.isnan(summarize("paged", 1.0, records, brief).queued_output_tokens_s)  # under MIN_QUEUED_S


# ---------------------------------------------------------------- end to end


def _rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _assert_png(path: str) -> None:
    import matplotlib.image

    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE, path
    height, width, _ = matplotlib.image.imread(path).shape
    assert height > 200 and width > 200


@pytest.mark.slow
def test_sweep_end_to_end_on_the_tiny_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "sweep"
    policies, rates = ["paged", "contiguous", "contiguous-max"], [8.0, 16.0]  # a server each: the suite's time
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.sweep", "--model", str(tiny_model_dir), "--max-model-len", "256",
         "--scale-lengths", "0.25", "--dataset", "alpaca", "--num-kv-blocks", "16", "--policies", ",".join(policies),
         "--rates", ",".join(map(str, rates)), "--num-requests", "4", "--run-all-rates", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = _rows(out / "summary.csv")
    assert [(r["policy"], float(r["rate_req_s"])) for r in summary] == [(p, r) for p in policies for r in rates]
    for row in summary:
        assert (int(row["num_requests"]), int(row["num_completed"]), int(row["num_failed"])) == (4, 4, 0), row
        assert 0 < float(row["normalized_latency_s_per_token"]) < math.inf
        assert float(row["throughput_output_tokens_s"]) > 0 and float(row["ttft_p90_s"]) >= float(row["ttft_p50_s"])
        assert float(row["max_send_lag_s"]) >= 0 and float(row["load_avg_1m"]) >= 0
    timeline = _rows(out / "timeline.csv")
    assert {(r["policy"], float(r["rate_req_s"])) for r in timeline} == {(p, r) for p in policies for r in rates}
    # every sample read the pool's size and this moment's slots from /health
    assert all(r["num_blocks_total"] == "16" and r["num_slots_used"] != "" and r["num_slots_allocated"] != ""
               for r in timeline)
    for name in ("latency_vs_rate.png", "timeline.png"):
        _assert_png(out / name)
    # the capacity model before the runs, and each ratio named by its Orca reservation beside the model's
    assert "capacity model (KV memory alone" in proc.stdout
    for label in ("contiguous, reserves prompt + output (Orca Oracle)",
                  "contiguous, reserves the whole context (Orca Max)"):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"paged / {label}: "))
        assert "KV memory alone predicts" in line, line
    assert "output tokens/s while requests waited (the KV pool full)" in proc.stdout
    assert "(timeline each policy at its highest swept rate)" in proc.stdout
    assert "[paged 8 req/s, rate 1/2] 4/4 done" in proc.stdout  # the progress lines
    # the contiguous policies share one server, and rates are interleaved: every policy at 8, then at 16
    assert proc.stdout.count("starting pagedserve serve") == 2
    assert proc.stdout.index("[contiguous-max] rate 8 req/s") < proc.stdout.index("[paged] rate 16 req/s")

    os.remove(out / "timeline.png")
    from loadtest.sweep.main import main as sweep_main

    capsys.readouterr()
    sweep_main(["--plot-only", "--out", str(out), "--timeline-rate", "8"])  # in this process: no second start-up
    assert "(timeline at 8 req/s)" in capsys.readouterr().out
    _assert_png(out / "timeline.png")
