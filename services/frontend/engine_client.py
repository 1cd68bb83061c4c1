"""The frontend's side of the scheduler link: the only code here that touches ZeroMQ.

A PUSH socket carries ``AddRequest`` / ``AbortRequest`` to the scheduler; a PULL socket brings back
``RequestOutput`` deltas and ``EngineStats``. Both connect (the scheduler binds). One background
task reads the PULL socket and routes each output to its request's queue.

A request has ``sampling.n`` choices (``choice_idx`` 0 .. n-1) and is over when each has sent its
last output (one with a ``finish_reason``), or at once on an ``"error"`` or ``"abort"``. Beam
search may return fewer than ``n`` hypotheses, all in one burst at the end; the scheduler sends
its outputs and its ``EngineStats`` in order on one socket, so the first ``EngineStats`` after a
beam request's first finished output marks the end of that burst: the request's queue then gets
``None`` ("nothing more will come").
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgpack
import structlog
import zmq
import zmq.asyncio

from shared.endpoints import Endpoints
from shared.messages import (
    AbortRequest, AddRequest, DecodeError, EngineStats, RequestOutput, decode, encode,
)

log = structlog.get_logger()


@dataclass
class _Route:
    """Where one request's outputs go, and which of its choices have ended."""

    queue: asyncio.Queue[RequestOutput | None]
    num_choices: int
    beam_search: bool
    finished: set[int] = field(default_factory=set)


class EngineClient:
    """Sends requests to the scheduler and routes its outputs to per-request queues.

    Contract: ``add_request`` registers the request's queue before the request is sent, so no
    output can arrive unrouted. A queue receives every ``RequestOutput`` of its request, each
    choice's last one with a ``finish_reason``, and for beam search possibly a final ``None`` (see
    the module docstring). Once every choice has ended (or after ``abort``) the request is
    unregistered and later outputs for it are dropped. Must be used from one event loop.
    """

    def __init__(self, endpoints: Endpoints, context: zmq.asyncio.Context | None = None) -> None:
        self._endpoints = endpoints
        self._own_context = context is None
        self._context = context or zmq.asyncio.Context()
        self._push: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._routes: dict[str, _Route] = {}
        self._ending: set[str] = set()  # beam requests whose final burst has begun
        self.latest_stats: EngineStats | None = None
        self.latest_stats_time: float | None = None  # time.monotonic() when it arrived
        self.num_dropped_frames = 0

    async def start(self) -> None:
        push = self._context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self._endpoints.request)
        pull = self._context.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.connect(self._endpoints.output)
        self._push, self._pull = push, pull
        self._reader = asyncio.create_task(self._read_outputs(), name="engine-output-reader")
        log.info("connected to the scheduler", request=self._endpoints.request, output=self._endpoints.output)

    async def close(self) -> None:
        """Stop the reader and close both sockets at once (linger 0); idempotent."""
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
            self._reader = None
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._push = self._pull = None
        if self._own_context:
            self._context.term()

    @property
    def num_pending(self) -> int:
        return len(self._routes)

    def add_request(self, request: AddRequest) -> asyncio.Queue[RequestOutput | None]:
        """Register ``request`` and send it; returns the queue its outputs will arrive on."""
        if request.request_id in self._routes:
            raise ValueError(f"request id {request.request_id} is already running")
        queue: asyncio.Queue[RequestOutput | None] = asyncio.Queue()
        sampling = request.sampling
        self._routes[request.request_id] = _Route(queue, max(1, sampling.n), sampling.use_beam_search)
        self._send(encode(request))
        return queue

    def abort(self, request_id: str) -> None:
        """Tell the scheduler to stop ``request_id`` and forget it here. Never blocks, never awaits,
        so it is safe in ``finally`` blocks of cancelled tasks."""
        self._unregister(request_id)
        if self._push is not None:
            self._send(encode(AbortRequest(request_id)))
        log.info("request aborted", request_id=request_id)

    def abort_all(self, reason: str) -> int:
        """Abort every registered request at the scheduler and end each one's queue with a
        ``finish_reason="abort"`` output carrying ``reason`` (used at shutdown). Returns how many."""
        request_ids = list(self._routes)
        for request_id in request_ids:
            queue = self._routes[request_id].queue
            self.abort(request_id)
            queue.put_nowait(RequestOutput(request_id, 0, [], "abort", error=reason))
        return len(request_ids)

    def _send(self, frame: bytes) -> None:
        if self._push is None:
            raise RuntimeError("EngineClient is not started")
        future = self._push.send(frame, copy=False)
        future.add_done_callback(_log_send_failure)

    async def _read_outputs(self) -> None:
        assert self._pull is not None
        while True:
            frame = await self._pull.recv(copy=False)
            try:
                self._handle(frame.bytes)
            except Exception:  # one bad frame must not stop the routing of all the others
                self.num_dropped_frames += 1
                log.exception("failed to handle a frame from the scheduler")

    def _handle(self, frame: bytes) -> None:
        try:
            message = decode(frame)
        except DecodeError as exc:
            self.num_dropped_frames += 1
            request_id = _peek_request_id(frame)
            log.error("dropped an undecodable frame from the scheduler", error=str(exc), size=len(frame),
                      request_id=request_id)
            if request_id is not None:  # fail that request rather than leave it waiting forever
                self._route(RequestOutput(request_id, 0, [], "error", error=f"engine output was malformed: {exc}"))
            return
        if isinstance(message, RequestOutput):
            self._route(message)
        elif isinstance(message, EngineStats):
            if self.latest_stats is None or message.ready != self.latest_stats.ready:
                log.info("scheduler readiness", ready=message.ready)
            self.latest_stats = message
            self.latest_stats_time = time.monotonic()
            self._end_beam_bursts()
        else:
            self.num_dropped_frames += 1
            log.error("dropped an unexpected message from the scheduler", type=type(message).__name__)

    def _route(self, output: RequestOutput) -> None:
        route = self._routes.get(output.request_id)
        if route is None:
            log.debug("output for an unknown or finished request", request_id=output.request_id)
            return
        reason = output.finish_reason
        if reason is not None and reason not in ("stop", "length"):
            self._unregister(output.request_id)  # an error or abort ends every choice
        elif not 0 <= output.choice_idx < route.num_choices or output.choice_idx in route.finished:
            self.num_dropped_frames += 1
            log.error("dropped an output for a choice the request does not have", request_id=output.request_id,
                      choice_idx=output.choice_idx, num_choices=route.num_choices)
            return
        elif reason is not None:
            route.finished.add(output.choice_idx)
            if len(route.finished) == route.num_choices:
                self._unregister(output.request_id)
            elif route.beam_search:
                self._ending.add(output.request_id)
        route.queue.put_nowait(output)

    def _unregister(self, request_id: str) -> None:
        self._routes.pop(request_id, None)
        self._ending.discard(request_id)

    def _end_beam_bursts(self) -> None:
        """Stats follow the outputs sent before them: a beam request that began its final burst
        before these stats has received all of it."""
        for request_id in list(self._ending):
            route = self._routes[request_id]
            self._unregister(request_id)
            route.queue.put_nowait(None)


def _peek_request_id(frame: bytes) -> str | None:
    """The request id of a malformed ``RequestOutput`` frame, when it can still be read."""
    try:
        tag, fields = msgpack.unpackb(frame, raw=False)
        if tag == RequestOutput.TAG and isinstance(fields[0], str):
            return fields[0]
    except Exception:  # anything at all may be wrong with this frame
        pass
    return None


def _log_send_failure(future: asyncio.Future) -> None:
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        log.error("sending to the scheduler failed", error=repr(exc))
