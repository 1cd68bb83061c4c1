"""The frontend across a scheduler restart: its request table (``RequestRoutes``) hands every request
in flight to the new scheduler and stitches the outputs back into one request; the engine client
notices the silence, then the new epoch, and resubmits; /health says what it sees."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import zmq

from services.frontend.engine_client import EngineClient
from services.frontend.health_report import health_report
from services.frontend.request_routes import RESUME_REFUSED, RequestRoutes
from shared.endpoints import Endpoints
from shared.messages import (
    AbortRequest, AddRequest, EngineStats, ExecutorHealth, FrontendHello, RequestOutput, RequestOutputs,
    SamplingParams, decode, encode,
)


def _add(request_id="r", **sampling) -> AddRequest:
    params = SamplingParams(**{"eos_token_ids": [0], **sampling})
    return AddRequest(request_id, np.array([1, 2, 3], np.int32), params, 12.5)


def _drain(queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_a_request_with_no_output_yet_goes_again_whole():
    routes = RequestRoutes()
    routes.add(_add(n=2, seed=5))
    abort, again = routes.resubmissions()
    assert abort == AbortRequest("r")
    assert again.request_id == "r.r1" and again.sampling.n == 2 and len(again.resumed_token_ids) == 0
    assert again.arrival_time == 12.5  # keeps its place in the queue
    queue = routes._routes["r"].queue
    routes.route(RequestOutput("r", 0, [9]))  # the old part: no longer routed
    routes.route(RequestOutput("r.r1", 1, [4]))
    assert [(o.request_id, o.choice_idx, o.new_token_ids) for o in _drain(queue)] == [("r", 1, [4])]


def test_choices_resume_one_by_one_with_their_tokens_and_outputs_are_stitched_back():
    routes = RequestRoutes()
    queue = routes.add(_add(n=3, seed=5, temperature=1.0))
    routes.route(RequestOutput("r", 0, [10, 11]))
    routes.route(RequestOutput("r", 1, [20], "stop"))
    routes.route(RequestOutput("r", 2, [30]))
    messages = routes.resubmissions()
    assert messages[0] == AbortRequest("r")
    parts = {m.request_id: m for m in messages[1:]}
    assert set(parts) == {"r.r1.c0", "r.r1.c2"}  # choice 1 had finished
    assert parts["r.r1.c0"].resumed_token_ids.tolist() == [10, 11] and parts["r.r1.c0"].sampling.seed == 5
    assert parts["r.r1.c2"].resumed_token_ids.tolist() == [30] and parts["r.r1.c2"].sampling.seed == 7
    assert all(m.sampling.n == 1 and m.prompt_token_ids.tolist() == [1, 2, 3] for m in parts.values())
    routes.route(RequestOutput("r.r1.c2", 0, [31], "length", request_finished=True))
    assert "r" in routes
    routes.route(RequestOutput("r.r1.c0", 0, [12], "length", request_finished=True))
    assert "r" not in routes
    outs = _drain(queue)
    assert [(o.request_id, o.choice_idx, o.new_token_ids, o.finish_reason) for o in outs[-2:]] == [
        ("r", 2, [31], "length"), ("r", 0, [12], "length")]
    # A second restart resumes from everything received, under new ids.
    routes2 = RequestRoutes()
    routes2.add(_add(n=1))
    routes2.route(RequestOutput("r", 0, [1]))
    routes2.resubmissions()
    routes2.route(RequestOutput("r.r1.c0", 0, [2]))
    _, again = routes2.resubmissions()
    assert again.request_id == "r.r2.c0" and again.resumed_token_ids.tolist() == [1, 2]


def test_an_error_in_one_part_ends_the_request_and_aborts_the_others():
    routes = RequestRoutes()
    queue = routes.add(_add(n=2))
    routes.route(RequestOutput("r", 0, [1]))
    routes.route(RequestOutput("r", 1, [2]))
    routes.resubmissions()
    assert routes.route(RequestOutput("r.r1.c1", 0, [], "error", error="boom", request_finished=True)) == ["r.r1.c0"]
    assert _drain(queue)[-1].error == "boom" and "r" not in routes
    assert routes.remove("r") == []


def test_held_back_groups_run_again_or_fail_clearly():
    routes = RequestRoutes()
    routes.add(_add("beam", n=2, use_beam_search=True))
    routes.add(_add("best", n=1, best_of=3))
    queue = routes.add(_add("best-sent", n=2, best_of=3))
    routes.route(RequestOutput("best-sent", 0, [5], "length"))  # part of its result came before the crash
    messages = routes.resubmissions()
    assert [m.request_id for m in messages if isinstance(m, AddRequest)] == ["beam.r1", "best.r1"]
    [failure] = _drain(queue)[1:]
    assert failure.finish_reason == "abort" and failure.error == RESUME_REFUSED
    assert "best-sent" not in routes


def _stats(epoch: int, ready: bool = True, executor_restarts: int = 0) -> EngineStats:
    return EngineStats(0, 0, 10, 0, 0, 0, ready, epoch=epoch, pid=4,
                       executors=[ExecutorHealth(0, 5, "ok" if ready else "lost", 0.1, executor_restarts)])


@pytest.mark.slow  # waits out a scheduler's silence
def test_engine_client_hands_its_requests_to_a_restarted_scheduler(tmp_path):
    endpoint = Endpoints.in_directory(str(tmp_path)).request
    ctx = zmq.Context()

    def scheduler() -> zmq.Socket:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        return sock

    async def receive(sock: zmq.Socket, kind: type, num: int = 1) -> tuple[bytes, list]:
        found, identity = [], None
        for _ in range(1000):
            if sock.poll(0):
                identity, frame = sock.recv_multipart()
                message = decode(frame)
                if isinstance(message, kind):
                    found.append(message)
                    if len(found) == num:
                        return identity, found
            else:
                await asyncio.sleep(0.01)
        raise AssertionError(f"no {kind.__name__}")

    async def run() -> None:
        first = scheduler()
        client = EngineClient(Endpoints(endpoint, "", ""), heartbeat_timeout_s=0.5, silence_timeout_s=60)
        await client.start()
        try:
            identity, _ = await receive(first, FrontendHello)
            first.send_multipart([identity, encode(_stats(1, executor_restarts=2))])
            queue = client.add_request(_add("r", n=1, max_tokens=8))
            await receive(first, AddRequest)
            first.send_multipart([identity, encode(RequestOutputs([RequestOutput("r", 0, [7, 8])]))])
            assert (await queue.get()).new_token_ids == [7, 8]
            assert health_report(client, client.process_restarts())[0] == 200
            first.close()  # the scheduler dies
            for _ in range(500):
                if client.scheduler_lost:
                    break
                await asyncio.sleep(0.01)
            status, body = health_report(client, client.process_restarts())
            assert status == 503 and "the scheduler has not answered" in body["reason"]
            second = scheduler()  # a new one, on the same endpoint, knowing nothing
            identity, _ = await receive(second, FrontendHello)
            second.send_multipart([identity, encode(_stats(2, ready=False))])
            await asyncio.sleep(0.3)
            assert client.num_scheduler_restarts == 1
            client.add_request(_add("s", n=1, max_tokens=8))  # sent to the new scheduler: not handed again
            await asyncio.sleep(0.3)
            early = [decode(second.recv_multipart()[1]) for _ in range(20) if second.poll(0)]
            assert [m.request_id for m in early if isinstance(m, AddRequest)] == ["s"]  # "r" waits for ready
            second.send_multipart([identity, encode(_stats(2))])
            _, [again] = await receive(second, AddRequest)
            assert again.request_id == "r.r1.c0" and again.resumed_token_ids.tolist() == [7, 8]
            await asyncio.sleep(0.3)
            assert not [m for m in (decode(second.recv_multipart()[1]) for _ in range(20) if second.poll(0))
                        if isinstance(m, AddRequest)]
            client.abort("s")
            second.send_multipart([identity, encode(RequestOutputs([
                RequestOutput("r.r1.c0", 0, [9], "length", request_finished=True)]))])
            last = await asyncio.wait_for(queue.get(), 10)
            assert (last.request_id, last.new_token_ids, last.finish_reason) == ("r", [9], "length")
            assert client.process_restarts() == {"executor": 2, "scheduler": 1, "frontend": 0}
            status, body = health_report(client, client.process_restarts())
            assert status == 200 and client.num_pending == 0
            # /health's counts are /metrics': the executor restarts the first scheduler saw are kept
            assert body["processes"]["scheduler"]["num_restarts"] == 1
            assert [e["num_restarts"] for e in body["processes"]["executors"]] == [2]
            second.close()
        finally:
            await client.close()

    started = time.monotonic()
    try:
        asyncio.run(run())
    finally:
        ctx.term()
    assert time.monotonic() - started < 120
