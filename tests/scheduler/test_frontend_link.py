"""The scheduler's link to its frontends (ROUTER) and a frontend's engine client (DEALER): outputs go
to the frontend that sent the request, stats to all, a vanished frontend's requests come back for
aborting, and a frontend whose scheduler falls silent fails its requests."""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import structlog
import zmq

from services.frontend.engine_client import EngineClient
from services.frontend.malformed_frames import readable_outputs
from services.scheduler.frontends import FrontendLink
from shared.endpoints import Endpoints
from shared.messages import (
    AddRequest, EngineStats, FrontendHello, RequestOutput, RequestOutputs, SamplingParams, decode, encode,
)

STATS = EngineStats(0, 0, 10, 0, 0, 0, True)


def _add(request_id: str) -> AddRequest:
    return AddRequest(request_id, np.array([1, 2, 3], np.int32), SamplingParams(eos_token_ids=[0]), 0.0)


def _dealer(ctx: zmq.Context, endpoint: str, identity: bytes) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    return sock


def _next(sock: zmq.Socket):
    assert sock.poll(60_000), "nothing arrived"  # a guard against a hang only
    return decode(sock.recv())


def _receive(link: FrontendLink, num: int) -> list:
    messages, deadline = [], time.monotonic() + 60
    while len(messages) < num and time.monotonic() < deadline:
        message = link.recv(100)
        if message is not None:
            messages.append(message)
    return messages


def test_outputs_go_to_their_frontend_stats_to_all_and_orphans_come_back(tmp_path):
    ctx = zmq.Context()
    endpoint = Endpoints.in_directory(str(tmp_path)).request
    link = FrontendLink(ctx, endpoint, structlog.get_logger())
    a, b = _dealer(ctx, endpoint, b"frontend-a"), _dealer(ctx, endpoint, b"frontend-b")
    try:
        a.send(encode(FrontendHello(1)))
        b.send(encode(_add("rb")))
        a.send(encode(_add("ra")))
        assert len(_receive(link, 3)) == 3
        assert set(link.frontends) == {b"frontend-a", b"frontend-b"}
        link.send_outputs([RequestOutput("rb", 0, [7]), RequestOutput("ra", 0, [8]), RequestOutput("rb", 0, [6])])
        link.send_outputs([RequestOutput("ra", 0, [9], "stop", request_finished=True)])
        link.send_outputs([RequestOutput("ra", 0, [10])])  # after its end: nobody owns it, dropped
        link.send_stats(STATS)
        # one frame per frontend and pass, each frontend's outputs in order; nothing between
        assert [[o.new_token_ids for o in _next(a).outputs] for _ in range(2)] == [[[8]], [[9]]]
        assert type(_next(a)) is EngineStats
        assert [[o.new_token_ids for o in _next(b).outputs], type(_next(b))] == [[[7], [6]], EngineStats]
        b.close()  # gone without aborting rb
        orphans, deadline = [], time.monotonic() + 60
        while not orphans and time.monotonic() < deadline:
            link.send_stats(STATS)  # the next send to b finds it gone
            orphans = link.take_orphans()
            time.sleep(0.02)
        assert orphans == ["rb"] and set(link.frontends) == {b"frontend-a"} and link.num_lost == 1
        assert link.take_orphans() == []
    finally:
        a.close()
        link.socket.close()
        ctx.term()


def test_engine_client_fails_its_requests_when_the_scheduler_falls_silent(tmp_path):
    endpoint = Endpoints.in_directory(str(tmp_path)).request
    ctx = zmq.Context()
    scheduler = ctx.socket(zmq.ROUTER)
    scheduler.bind(endpoint)

    async def run() -> tuple[RequestOutput, int]:
        client = EngineClient(Endpoints(endpoint, "", ""), silence_timeout_s=0.2)
        await client.start()
        try:
            identity, hello = await asyncio.to_thread(scheduler.recv_multipart)
            assert isinstance(decode(hello), FrontendHello)
            scheduler.send_multipart([identity, encode(STATS)])  # answers once, then never again
            for _ in range(3000):  # 30 s at most
                if client.latest_stats is not None:
                    break
                await asyncio.sleep(0.01)
            queue = client.add_request(_add("r"))
            return await asyncio.wait_for(queue.get(), timeout=60), client.num_pending
        finally:
            await client.close()

    try:
        output, num_pending = asyncio.run(run())
    finally:
        scheduler.close(linger=0)
        ctx.term()
    assert output.finish_reason == "abort" and output.request_finished and num_pending == 0
    assert "the scheduler has not answered for" in output.error


def test_a_silent_frontend_is_forgotten_its_requests_orphaned_and_it_is_told(tmp_path):
    ctx = zmq.Context()
    endpoint = Endpoints.in_directory(str(tmp_path)).request
    link = FrontendLink(ctx, endpoint, structlog.get_logger(), silence_timeout_s=5.0)
    a = _dealer(ctx, endpoint, b"frontend-a")
    try:
        a.send(encode(_add("ra")))
        a.send(encode(_add("rb")))
        assert len(_receive(link, 2)) == 2
        heard = link.frontends[b"frontend-a"]
        link.forget_silent(heard + 4.0)
        assert link.take_orphans() == [] and b"frontend-a" in link.frontends
        link.excuse(3.0)  # the scheduler itself was stalled for 3 s: not the frontend's silence
        link.forget_silent(heard + 7.5)
        assert link.take_orphans() == [] and b"frontend-a" in link.frontends
        link.forget_silent(heard + 8.5)
        assert link.take_orphans() == ["ra", "rb"] and not link.frontends and link.num_lost == 1
        told = _next(a)  # alive after all: its requests must not wait forever; one frame tells of both
        assert isinstance(told, RequestOutputs) and [o.request_id for o in told.outputs] == ["ra", "rb"]
        assert all(o.finish_reason == "abort" and o.request_finished and "heard nothing" in o.error
                   for o in told.outputs)
        a.send(encode(FrontendHello(1)))  # it comes back
        assert len(_receive(link, 1)) == 1 and b"frontend-a" in link.frontends
    finally:
        a.close()
        link.socket.close()
        ctx.term()


def test_a_malformed_batch_still_delivers_its_good_outputs_and_fails_the_broken_ones():
    good = msgpack.unpackb(encode(RequestOutput("ok", 0, [5])))[1]  # its fields as the wire has them
    frame = msgpack.packb([RequestOutputs.TAG, [[good, ["broken", 0, "not a list"], [7]]]])
    readable = readable_outputs(frame)
    assert readable == [RequestOutput("ok", 0, [5]), "broken"]  # the last has no readable id
    # outputs only ever come in RequestOutputs frames: anything else yields nothing
    assert readable_outputs(msgpack.packb([RequestOutput.TAG, ["alone", 0]])) == []
    assert readable_outputs(b"\x00not msgpack") == []
