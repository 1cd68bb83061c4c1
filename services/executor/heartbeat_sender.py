"""The executor's liveness signal: a ``Heartbeat`` to the scheduler every ``HEARTBEAT_INTERVAL_S``.

It runs on a thread of its own with a socket of its own (ZeroMQ sockets are not shared between
threads), so it keeps beating while the main thread runs a long step (torch and our Numba kernels
release the GIL), and stops when the process dies or is stopped (SIGSTOP): what the scheduler's
``--heartbeat-timeout`` watches. Beats are dropped rather than queued when no scheduler is
connected (a restarted scheduler gets fresh ones, not a backlog).
"""

from __future__ import annotations

import os
import threading

import zmq

from shared.messages import Heartbeat, encode
from shared.zmq_auth import CurveKeys, secure_client

HEARTBEAT_INTERVAL_S = 1.0


class HeartbeatThread:
    def __init__(self, context: zmq.Context, endpoint: str, rank: int, incarnation: int,
                 interval_s: float = HEARTBEAT_INTERVAL_S, curve: CurveKeys | None = None) -> None:
        self._context = context
        self._curve = curve
        self._endpoint = endpoint
        self._frame = encode(Heartbeat(rank, incarnation, os.getpid()))
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-rank{rank}", daemon=True)

    def start(self) -> "HeartbeatThread":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and close the thread's socket (before the context is terminated)."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queue for a scheduler that is not there
        sock.setsockopt(zmq.SNDHWM, 4)
        secure_client(sock, self._curve)
        sock.connect(self._endpoint)
        try:
            while True:
                try:
                    sock.send(self._frame, zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no scheduler right now; the next beat will do
                if self._stop.wait(self._interval_s):
                    return
        finally:
            sock.close(linger=0)
