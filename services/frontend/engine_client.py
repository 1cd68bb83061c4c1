"""The frontend's side of the scheduler link: the only code here that touches ZeroMQ.

One DEALER socket connects to the scheduler's ROUTER (``endpoints.request``) under an identity
unique to this frontend process. It carries ``FrontendHello``, ``AddRequest`` and ``AbortRequest``
out, and brings back this frontend's ``RequestOutput`` deltas (the scheduler sends each request's
outputs to the frontend that sent the request) and ``EngineStats`` (sent to every frontend every
0.5 s). One background task reads the socket and routes each output to its request's queue
(``request_routes``); a second one says hello every second (the scheduler's sign that this
frontend lives; a restarted scheduler learns of it that way) and watches the scheduler's silence.
With ``--zmq-curve`` the DEALER is a CURVE client of the scheduler (``shared.zmq_auth``).

The scheduler's liveness: silent for ``heartbeat_timeout_s`` it counts as lost (``scheduler_lost``:
/health says 503, new requests get a 503); silent for ``silence_timeout_s`` every waiting request
fails. A new epoch in its stats means a new scheduler process: once it is ready every request in
flight is handed to it (``RequestRoutes.resubmissions``) and continues where it was. Restarts seen
are counted here: the scheduler's, and the executors' (reported by each scheduler; the counts of
earlier schedulers are kept); under ``pagedserve serve`` /metrics and /health show the launcher's
instead (``metrics``).

For the playground, ``watch_kv`` asks the scheduler for block-pool snapshots (``KvWatch``), which
arrive at ``on_kv_snapshot`` (``kv_stream.KvHub``).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Callable

import structlog
import zmq
import zmq.asyncio

from shared.endpoints import Endpoints
from shared.engine_flags import LivenessFlags
from shared.zmq_auth import CurveKeys, secure_client
from services.frontend.malformed_frames import salvaged_outputs
from services.frontend.request_routes import RequestRoutes
from services.frontend.scheduler_history import SchedulerHistory
from shared.messages import (
    AbortRequest, AddRequest, DecodeError, EngineStats, FrontendHello, KvSnapshot, KvWatch, RequestOutput,
    RequestOutputs, decode, encode,
)

log = structlog.get_logger()

HELLO_INTERVAL_S = 1.0  # the scheduler sends stats every 0.5 s to the frontends it knows, even mid-step
HEARTBEAT_TIMEOUT_S = LivenessFlags().heartbeat_timeout  # silent this long, the scheduler is lost (restarting, we hope)
SILENCE_TIMEOUT_S = 60.0  # silent this long, the requests waiting for it fail


class EngineClient:
    """Sends requests to the scheduler and routes its outputs to per-request queues.

    Contract: ``add_request`` registers the request's queue before the request is sent, so no
    output can arrive unrouted. A queue receives every ``RequestOutput`` of its request, each
    choice's last one with a ``finish_reason``, and possibly a final ``None`` (see
    ``request_routes``), across scheduler restarts. Once the request is over (or after ``abort``)
    it is unregistered and later outputs for it are dropped. Must be used from one event loop.
    """

    def __init__(self, endpoints: Endpoints, context: zmq.asyncio.Context | None = None,
                 silence_timeout_s: float = SILENCE_TIMEOUT_S,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, curve: CurveKeys | None = None) -> None:
        self._endpoints = endpoints
        self._curve = curve
        self._own_context = context is None
        self._context = context or zmq.asyncio.Context()
        self.identity = f"frontend-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
        self.silence_timeout_s = silence_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self.routes = RequestRoutes()
        self._last_frame_time: float | None = None  # time.monotonic() of anything from the scheduler
        self._waiting_since = 0.0  # when the first of the registered requests was sent
        self._lost_logged = False
        self._num_dropped_frames = 0
        self.history = SchedulerHistory()  # the latest stats; restarts and counters across schedulers
        self._resubmit: set[str] | None = None  # a new scheduler: the requests to hand it once it is ready
        self.on_kv_snapshot: Callable[[KvSnapshot], None] | None = None

    @property
    def num_dropped_frames(self) -> int:
        return self._num_dropped_frames + self.routes.num_dropped

    # what the link has seen of its schedulers (``scheduler_history``)

    @property
    def latest_stats(self) -> EngineStats | None:
        return self.history.latest

    @property
    def scheduler_epoch(self) -> int | None:
        return self.history.epoch

    @property
    def num_scheduler_restarts(self) -> int:
        return self.history.num_restarts

    @property
    def num_executor_restarts(self) -> int:
        return self.history.num_executor_restarts

    @property
    def ever_ready(self) -> bool:
        return self.history.ever_ready

    def process_restarts(self) -> dict[str, int]:
        return self.history.process_restarts()

    def counters(self) -> dict[str, int]:
        return self.history.counters()

    def scheduler_silence_s(self) -> float | None:
        """Seconds since the scheduler was last heard from (None: never)."""
        return None if self._last_frame_time is None else time.monotonic() - self._last_frame_time

    @property
    def scheduler_lost(self) -> bool:
        """Heard from once, silent for ``heartbeat_timeout_s`` since."""
        silence = self.scheduler_silence_s()
        return silence is not None and silence > self.heartbeat_timeout_s

    async def start(self) -> None:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        secure_client(sock, self._curve)
        sock.connect(self._endpoints.request)
        self._socket = sock
        self._hello()
        self._tasks = [asyncio.create_task(self._read_outputs(), name="engine-output-reader"),
                       asyncio.create_task(self._watch_silence(), name="engine-silence-watch")]
        log.info("connected to the scheduler", endpoint=self._endpoints.request, identity=self.identity.decode(),
                 zmq_security="curve" if self._curve else "plain")

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
        return len(self.routes)

    def add_request(self, request: AddRequest) -> asyncio.Queue[RequestOutput | None]:
        """Register ``request`` and send it; returns the queue its outputs will arrive on."""
        if not self.routes:
            self._waiting_since = time.monotonic()
        queue = self.routes.add(request)
        self._send(encode(request))
        return queue

    def abort(self, request_id: str) -> None:
        """Tell the scheduler to stop ``request_id`` and forget it here. Never blocks, never awaits,
        so it is safe in ``finally`` blocks of cancelled tasks."""
        self._abort_parts(self.routes.remove(request_id) or [request_id])
        log.info("request aborted", request_id=request_id)

    def abort_all(self, reason: str) -> int:
        """Abort every registered request at the scheduler and end each one's queue with a
        ``finish_reason="abort"`` output carrying ``reason`` (used at shutdown). Returns how many."""
        num = len(self.routes)
        self._abort_parts(self.routes.end_all(reason))
        return num

    def _abort_parts(self, parts: list[str]) -> None:
        if self._socket is not None:
            for part in parts:
                self._send(encode(AbortRequest(part)))

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
            self._hello()  # also this frontend's heartbeat
            silence = self.scheduler_silence_s()
            if silence is None:
                continue  # never heard from: the scheduler may still be starting
            if self.scheduler_lost and not self._lost_logged:
                log.error("scheduler lost: no stats", seconds=round(silence, 1), num_requests=len(self.routes))
            self._lost_logged = self.scheduler_lost
            silent_s = time.monotonic() - max(self._last_frame_time, self._waiting_since)
            if self.routes and silent_s > self.silence_timeout_s:
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
                self._num_dropped_frames += 1
                log.exception("failed to handle a frame from the scheduler")

    def _handle(self, frame: bytes) -> None:
        try:
            message = decode(frame)
        except DecodeError as exc:
            self._num_dropped_frames += 1
            for output in salvaged_outputs(frame, exc):  # the outputs that decode alone, and the failures
                self._route(output)
            return
        if isinstance(message, RequestOutputs):  # the one form outputs take (FrontendLink.send_outputs)
            for output in message.outputs:
                self._route(output)
        elif isinstance(message, EngineStats):
            self._on_stats(message)
        elif isinstance(message, KvSnapshot):
            if self.on_kv_snapshot is not None:
                self.on_kv_snapshot(message)
        else:
            self._num_dropped_frames += 1
            log.error("dropped an unexpected message from the scheduler", type=type(message).__name__)

    def _route(self, output: RequestOutput) -> None:
        self._abort_parts(self.routes.route(output))

    def _on_stats(self, stats: EngineStats) -> None:
        """Keep the latest stats; on a new scheduler epoch, count a restart and, once the new
        scheduler is ready, hand it every request in flight."""
        if self.latest_stats is None or stats.ready != self.latest_stats.ready:
            log.info("scheduler readiness", ready=stats.ready)
        if self.history.observe(stats):
            # Requests sent from now on reach the new scheduler; those before may have been lost.
            self._resubmit = (self._resubmit or set()) | self.routes.request_ids()
            log.warning("the scheduler restarted", epoch=stats.epoch, scheduler_pid=stats.pid,
                        num_requests=len(self.routes),
                        num_restarts=self.num_scheduler_restarts)
        if self._resubmit is not None and stats.ready:
            messages = self.routes.resubmissions(self._resubmit)
            self._resubmit = None
            for message in messages:
                self._send(encode(message))
            log.info("requests handed to the new scheduler", num_requests=len(self.routes),
                     num_messages=len(messages))


def _ignore_failure(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # retrieved, so that asyncio does not report it


def _log_send_failure(future: asyncio.Future) -> None:
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        log.error("sending to the scheduler failed", error=repr(exc))
