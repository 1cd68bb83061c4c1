"""The scheduler's link to its frontends: one ROUTER socket, and which frontend sent each request.

Frontends connect DEALER sockets, each under an identity of its own, to ``endpoints.request``. Every
message a frontend sends (``FrontendHello``, ``AddRequest``, ``AbortRequest``) makes it known. A
request's outputs go to the frontend that sent the request (each pass's outputs in one
``RequestOutputs`` frame per frontend), until the output marked ``request_finished``;
``EngineStats`` go to every known frontend; ``KvSnapshot`` to the frontends whose ``KvWatch`` is on
(``kv_watchers``: renewal times, which ``kv_publisher`` lets lapse). A frontend is forgotten when it
has gone away (the socket is ROUTER_MANDATORY, so sending to it fails) or has sent nothing for
``silence_timeout_s`` (frontends say hello every second: one that is silent is hung); the requests
it still had wait in ``take_orphans`` for the scheduler to abort, ``num_lost`` counts it, and its
watch ends.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from shared.messages import (
    AddRequest, DecodeError, EngineStats, KvWatch, RequestOutput, RequestOutputs, decode, encode,
)
from shared.engine_flags import LivenessFlags
from shared.zmq_auth import CurveKeys, secure_server


class FrontendLink:
    def __init__(self, context: zmq.Context, endpoint: str, log: Any, silence_timeout_s: float = LivenessFlags().heartbeat_timeout,
                 curve: CurveKeys | None = None) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        secure_server(self.socket, curve, "frontend")  # with --zmq-curve: frontends' keys only
        self.socket.bind(endpoint)
        self.log = log
        self.silence_timeout_s = silence_timeout_s
        self.frontends: dict[bytes, float] = {}  # identity -> time.monotonic() of its last message
        self.num_lost = 0  # frontends that went away or fell silent
        self._owners: dict[str, bytes] = {}  # request id -> identity of the frontend that sent it
        self._orphans: list[str] = []
        self.kv_watchers: dict[bytes, float] = {}  # identity -> time.monotonic() of its last KvWatch(on)

    def recv(self, timeout_ms: int) -> Any:
        """The next message from any frontend, or None on timeout. Bad frames are logged and dropped."""
        if timeout_ms and not self.socket.poll(timeout_ms):
            return None
        try:
            frames = self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        identity, frame = frames[0], frames[-1]
        if identity not in self.frontends:
            self.log.info("frontend connected", frontend=identity.decode(errors="replace"))
        self.frontends[identity] = time.monotonic()
        try:
            message = decode(frame)
        except DecodeError as exc:
            self.log.warning("dropped a bad frame", error=str(exc), num_bytes=len(frame))
            return None
        if isinstance(message, AddRequest):
            self._owners[message.request_id] = identity
        elif isinstance(message, KvWatch):
            if message.on:
                self.kv_watchers[identity] = time.monotonic()
            else:
                self.kv_watchers.pop(identity, None)
        return message

    def send_outputs(self, outputs: list[RequestOutput]) -> None:
        """Send each output to the frontend that sent its request: one ``RequestOutputs`` frame per
        frontend, the outputs in their order."""
        by_frontend: dict[bytes, list[RequestOutput]] = {}
        for output in outputs:
            identity = self._owners.get(output.request_id)
            if output.request_finished:
                self._owners.pop(output.request_id, None)
            if identity is None:
                self.log.warning("output for a request no frontend owns; dropped", request_id=output.request_id)
            else:
                by_frontend.setdefault(identity, []).append(output)
        for identity, batch in by_frontend.items():
            if not self._send(identity, encode(RequestOutputs(batch))):
                self.log.warning("frontend busy; outputs dropped", request_ids=[o.request_id for o in batch])

    def send_stats(self, stats: EngineStats) -> None:
        frame = encode(stats)
        for identity in list(self.frontends):
            self._send(identity, frame)

    def excuse(self, stall_s: float) -> None:
        """The scheduler was stalled for ``stall_s``: that was not the frontends' silence."""
        for identity in self.frontends:
            self.frontends[identity] += stall_s

    def forget_silent(self, now: float) -> None:
        """Forget the frontends silent for longer than ``silence_timeout_s`` (``now``: monotonic)."""
        for identity, last in list(self.frontends.items()):
            if now - last > self.silence_timeout_s:
                aborted = self._forget(identity, f"silent for {now - last:.1f} s")
                if aborted:  # if it still lives, its requests must not wait forever: one frame, as outputs go
                    self._send(identity, encode(RequestOutputs(
                        [error_output_for_lost_frontend(request_id, now - last) for request_id in aborted])))

    def send_kv_snapshot(self, frame: bytes) -> None:
        """To every watching frontend; one that is busy misses this snapshot, not the next."""
        for identity in list(self.kv_watchers):
            self._send(identity, frame)

    def take_orphans(self) -> list[str]:
        """Requests whose frontend has gone away since the last call."""
        orphans, self._orphans = self._orphans, []
        return orphans

    def _send(self, identity: bytes, frame: bytes) -> bool:
        """Send without blocking; False if the frontend's queue is full. A frontend that has gone
        away is forgotten and its requests become orphans."""
        try:
            self.socket.send_multipart([identity, frame], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
        if identity in self.frontends:
            self._forget(identity, "gone")
        return True

    def _forget(self, identity: bytes, why: str) -> list[str]:
        """Forget a frontend; its requests become orphans (returned too)."""
        self.frontends.pop(identity, None)
        self.num_lost += 1
        self.kv_watchers.pop(identity, None)
        gone = [rid for rid, owner in self._owners.items() if owner == identity]
        for request_id in gone:
            del self._owners[request_id]
        self._orphans += gone
        self.log.warning("frontend gone", frontend=identity.decode(errors="replace"), why=why,
                         num_requests=len(gone))
        return gone


def error_output_for_lost_frontend(request_id: str, silence_s: float) -> RequestOutput:
    return RequestOutput(request_id, 0, [], "abort", request_finished=True,
                         error=f"the scheduler heard nothing from this frontend for {silence_s:.1f} s and "
                               f"aborted the request (--heartbeat-timeout)")
