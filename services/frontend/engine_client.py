"""The frontend's side of the scheduler link: the only code here that touches ZeroMQ.

One DEALER socket connects to the scheduler's ROUTER (``endpoints.request``) under an identity
unique to this frontend process. It carries ``FrontendHello``, ``AddRequest`` and ``AbortRequest``
out, and brings back this frontend's ``RequestOutput`` deltas (the scheduler sends each request's
outputs to the frontend that sent the request) and ``EngineStats`` (sent to every frontend). One
background task reads the socket and routes each output to its request's queue; a second one says
hello again while the scheduler is silent (a restarted scheduler learns of this frontend that way)
and, once the scheduler has answered at all (before, it may still be loading the model), fails
every waiting request when the scheduler has been silent for ``silence_timeout_s``.

A request is over at its output marked ``request_finished``, or at once on an ``"error"`` or
``"abort"``. Beam search may return fewer than ``n`` hypotheses: the queue then gets ``None`` after
the last output ("the other choices will not come").

For the playground, ``watch_kv`` asks the scheduler for block-pool snapshots (``KvWatch``), which
arrive at ``on_kv_snapshot`` (``kv_stream.KvHub``).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import msgpack
import structlog
import zmq
import zmq.asyncio

from shared.endpoints import Endpoints
from shared.messages import (
    AbortRequest, AddRequest, DecodeError, EngineStats, FrontendHello, KvSnapshot, KvWatch, RequestOutput, decode,
    encode,
)

log = structlog.get_logger()

HELLO_INTERVAL_S = 1.0  # the scheduler sends stats every 0.5 s to the frontends it knows
SILENCE_TIMEOUT_S = 60.0  # far longer than any step; the scheduler gives a step 600 s


@dataclass
class _Route:
    """Where one request's outputs go, and which of its choices have ended."""

    queue: asyncio.Queue[RequestOutput | None]
    num_choices: int
    finished: set[int] = field(default_factory=set)


class EngineClient:
    """Sends requests to the scheduler and routes its outputs to per-request queues.

    Contract: ``add_request`` registers the request's queue before the request is sent, so no
    output can arrive unrouted. A queue receives every ``RequestOutput`` of its request, each
    choice's last one with a ``finish_reason``, and possibly a final ``None`` (see the module
    docstring). Once the request is over (or after ``abort``) it is unregistered and later outputs
    for it are dropped. Must be used from one event loop.
    """

    def __init__(self, endpoints: Endpoints, context: zmq.asyncio.Context | None = None,
                 silence_timeout_s: float = SILENCE_TIMEOUT_S) -> None:
        self._endpoints = endpoints
        self._own_context = context is None
        self._context = context or zmq.asyncio.Context()
        self.identity = f"frontend-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
        self.silence_timeout_s = silence_timeout_s
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._routes: dict[str, _Route] = {}
        self._last_frame_time: float | None = None  # time.monotonic() of anything from the scheduler
        self._waiting_since = 0.0  # when the first of the registered requests was sent
        self.latest_stats: EngineStats | None = None
        self.latest_stats_time: float | None = None  # time.monotonic() when it arrived
        self.num_dropped_frames = 0
        self.on_kv_snapshot: Callable[[KvSnapshot], None] | None = None

    async def start(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.connect(self._endpoints.request)
        self._socket = sock
        self._hello()
        self._tasks = [asyncio.create_task(self._read_outputs(), name="engine-output-reader"),
                       asyncio.create_task(self._watch_silence(), name="engine-silence-watch")]
        log.info("connected to the scheduler", endpoint=self._endpoints.request, identity=self.identity.decode())

    async def close(self) -> None:
        """Stop the background tasks and close the socket at once (linger 0); idempotent."""
        for task in self._tasks:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        if self._socket is not None:
            self._socket.close(linger=0)
        self._socket = None
        if self._own_context:
            self._context.term()

    @property
    def num_pending(self) -> int:
        return len(self._routes)

    def add_request(self, request: AddRequest) -> asyncio.Queue[RequestOutput | None]:
        """Register ``request`` and send it; returns the queue its outputs will arrive on."""
        if request.request_id in self._routes:
            raise ValueError(f"request id {request.request_id} is already running")
        if not self._routes:
            self._waiting_since = time.monotonic()
        queue: asyncio.Queue[RequestOutput | None] = asyncio.Queue()
        self._routes[request.request_id] = _Route(queue, max(1, request.sampling.n))
        self._send(encode(request))
        return queue

    def abort(self, request_id: str) -> None:
        """Tell the scheduler to stop ``request_id`` and forget it here. Never blocks, never awaits,
        so it is safe in ``finally`` blocks of cancelled tasks."""
        self._routes.pop(request_id, None)
        if self._socket is not None:
            self._send(encode(AbortRequest(request_id)))
        log.info("request aborted", request_id=request_id)

    def abort_all(self, reason: str) -> int:
        """Abort every registered request at the scheduler and end each one's queue with a
        ``finish_reason="abort"`` output carrying ``reason`` (used at shutdown). Returns how many."""
        request_ids = list(self._routes)
        for request_id in request_ids:
            queue = self._routes[request_id].queue
            self.abort(request_id)
            queue.put_nowait(RequestOutput(request_id, 0, [], "abort", error=reason, request_finished=True))
        return len(request_ids)

    def _send(self, frame: bytes) -> None:
        if self._socket is None:
            raise RuntimeError("EngineClient is not started")
        future = self._socket.send(frame, copy=False)
        future.add_done_callback(_log_send_failure)

    def _hello(self) -> None:
        """Announce this frontend; dropped rather than queued when the scheduler is not there."""
        future = self._socket.send(encode(FrontendHello(os.getpid())), zmq.NOBLOCK)
        future.add_done_callback(_ignore_failure)  # zmq.Again: the next hello will do

    def watch_kv(self, on: bool) -> None:
        """Ask for block-pool snapshots, or stop; dropped rather than queued if it cannot go now."""
        if self._socket is not None:
            self._socket.send(encode(KvWatch(on)), zmq.NOBLOCK).add_done_callback(_ignore_failure)

    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(HELLO_INTERVAL_S)
            now = time.monotonic()
            if self._last_frame_time is None or now - self._last_frame_time >= HELLO_INTERVAL_S:
                self._hello()
            if self._last_frame_time is None:
                continue  # never heard from: the scheduler may still be starting
            silent_s = now - max(self._last_frame_time, self._waiting_since)
            if self._routes and silent_s > self.silence_timeout_s:
                num = self.abort_all(f"the scheduler has not answered for {silent_s:.0f} s")
                log.error("scheduler silent; failed the waiting requests", seconds=round(silent_s),
                          num_requests=num)

    async def _read_outputs(self) -> None:
        assert self._socket is not None
        while True:
            frame = await self._socket.recv(copy=False)
            self._last_frame_time = time.monotonic()
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
                self._route(RequestOutput(request_id, 0, [], "error", error=f"engine output was malformed: {exc}",
                                          request_finished=True, error_kind="engine"))
            return
        if isinstance(message, RequestOutput):
            self._route(message)
        elif isinstance(message, EngineStats):
            if self.latest_stats is None or message.ready != self.latest_stats.ready:
                log.info("scheduler readiness", ready=message.ready)
            self.latest_stats = message
            self.latest_stats_time = time.monotonic()
        elif isinstance(message, KvSnapshot):
            if self.on_kv_snapshot is not None:
                self.on_kv_snapshot(message)
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
            self._routes.pop(output.request_id)  # an error or abort ends every choice
            route.queue.put_nowait(output)
            return
        if not 0 <= output.choice_idx < route.num_choices or output.choice_idx in route.finished:
            self.num_dropped_frames += 1
            log.error("dropped an output for a choice the request does not have", request_id=output.request_id,
                      choice_idx=output.choice_idx, num_choices=route.num_choices)
            return
        if reason is not None:
            route.finished.add(output.choice_idx)
        route.queue.put_nowait(output)
        if output.request_finished:
            self._routes.pop(output.request_id)
            if len(route.finished) < route.num_choices:
                route.queue.put_nowait(None)  # a beam search found fewer hypotheses than n


def _peek_request_id(frame: bytes) -> str | None:
    """The request id of a malformed ``RequestOutput`` frame, when it can still be read."""
    try:
        tag, fields = msgpack.unpackb(frame, raw=False)
        if tag == RequestOutput.TAG and isinstance(fields[0], str):
            return fields[0]
    except Exception:  # anything at all may be wrong with this frame
        pass
    return None


def _ignore_failure(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # retrieved, so that asyncio does not report it


def _log_send_failure(future: asyncio.Future) -> None:
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        log.error("sending to the scheduler failed", error=repr(exc))
