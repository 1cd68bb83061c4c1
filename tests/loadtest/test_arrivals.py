"""``loadtest.bench.arrivals`` against a fake streaming server (aiohttp, in-process): the arrivals' TTFT
and the background's tokens/s are what the server did, the background streams are closed at the
end, and the gaps, the order of runs and the printed table."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestServer

from loadtest.bench import arrivals


def _fake_server(state: dict) -> web.Application:
    """Background requests stream a token every 10 ms until the client leaves; a one-token request
    answers after 30 ms."""
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = b"data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode() + b"\n\n"
        if body["max_tokens"] == 1:
            await asyncio.sleep(0.03)
            await resp.write(chunk)
            await resp.write(b"data: [DONE]\n\n")
            state["arrivals"] += 1
            return resp
        state["open"] += 1
        try:
            for _ in range(body["max_tokens"]):
                await resp.write(chunk)
                await asyncio.sleep(0.01)
        finally:
            state["open"] -= 1
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


def test_measure_times_the_arrivals_and_counts_the_background():
    state = {"open": 0, "arrivals": 0}

    async def run():
        server = TestServer(_fake_server(state), host="127.0.0.1")
        await server.start_server()
        try:
            result = await arrivals.measure(str(server.make_url("")).rstrip("/"), "m", 3,
                                            [0.01, 0.02, 0.01, 0.02], seed=1)
            await asyncio.sleep(0.1)  # the server notices the closed streams
            return result
        finally:
            await server.close()

    result = asyncio.run(run())
    assert state["arrivals"] == 4 and len(result.ttfts_s) == 4
    assert all(0.03 <= t < 1.0 for t in result.ttfts_s)
    # three streams at about 100 tokens/s each (a loaded machine is slower, never faster)
    assert 30 < result.background_tok_s < 330
    assert state["open"] == 0  # the background streams were closed
    summary = result.summary()
    assert summary["TTFT median (ms)"] >= 30 and summary["TTFT p90 (ms)"] >= summary["TTFT median (ms)"]


def test_gaps_are_the_same_for_a_seed_and_within_half_to_one_and_a_half_times():
    gaps = arrivals.arrival_gaps(200, 0.1, seed=3)
    assert gaps == arrivals.arrival_gaps(200, 0.1, seed=3) != arrivals.arrival_gaps(200, 0.1, seed=4)
    assert all(0.05 <= g <= 0.15 for g in gaps)
    assert 0.09 < sum(gaps) / len(gaps) < 0.11


def test_variants_alternate_their_order():
    assert arrivals.run_order(2, 3) == [[0, 1], [1, 0], [0, 1]]


def test_the_table_shows_medians_and_ratios(capsys):
    runs = [[arrivals.Run([0.2, 0.2, 0.3], 100.0), arrivals.Run([0.2, 0.1, 0.2], 120.0)],
            [arrivals.Run([0.3, 0.3, 0.4], 100.0), arrivals.Run([0.4, 0.4, 0.4], 80.0)]]
    arrivals.print_results(["--plan-ahead-at 0.75", ""], runs)
    out = capsys.readouterr().out
    assert "round 1: --plan-ahead-at 0.75: TTFT median 200 ms, background 100 tok/s; (no extra flags): " \
           "TTFT median 300 ms" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("TTFT median (ms)"))
    assert line.split()[-3:] == ["200.0", "350.0", "1.75x"]  # medians of 200/200 and 300/400
    line = next(ln for ln in out.splitlines() if ln.startswith("background tok/s"))
    assert line.split()[-1] == "0.82x"  # 90 against 110
