"""The scheduler's link to its executor ranks, around ``ExecutorGroup`` (``liveness``): the only code
here that touches their sockets, and the supervisor's.

Sockets: ``step`` PUB (bound: ``Step``, ``Hello``, ``Shutdown`` to every rank), ``result`` PULL
(bound: ``StepResult``, ``ExecutorReady``, ``Heartbeat`` from the ranks), and, when a supervisor
is given (``pagedserve serve``'s launcher), a PUSH to it for ``ProcessLost`` reports, so that it
kills a hung process and starts a new one. With ``--zmq-curve`` the step and result sockets
accept the executors' keys only (``shared.zmq_auth``); the supervisor's ipc:// socket stays plain.

While some rank has not answered, ``Hello`` goes out every ``HELLO_INTERVAL_S`` (a SUB socket
joins late, and a restarted rank must learn our epoch), naming the processes of the groups lost
last: any of them still running exits, so that its supervisor replaces it (no supervisor socket
reaches a rank on another host or in another container).
"""

from __future__ import annotations

from typing import Any

import zmq

from shared.messages import (
    DecodeError, ExecutorReady, Heartbeat, Hello, ProcessLost, Shutdown, Step, StepResult, decode, encode,
)
from shared.zmq_auth import CurveKeys, secure_server

from .liveness import ExecutorGroup, Loss

HELLO_INTERVAL_S = 0.1


class ExecutorLink:
    def __init__(self, context: zmq.Context, step_endpoint: str, result_endpoint: str, group: ExecutorGroup,
                 epoch: int, log: Any, supervisor_endpoint: str | None = None, curve: CurveKeys | None = None) -> None:
        self.group = group
        self.epoch = epoch
        self.log = log
        self.steps = _socket(context, zmq.PUB)
        secure_server(self.steps, curve, "executor")  # a step carries prompts: executors' keys only
        self.steps.bind(step_endpoint)
        self.results = _socket(context, zmq.PULL)
        secure_server(self.results, curve, "executor")
        self.results.bind(result_endpoint)
        self.supervisor = None
        if supervisor_endpoint:
            self.supervisor = _socket(context, zmq.PUSH)
            self.supervisor.connect(supervisor_endpoint)
        self._last_hello = float("-inf")

    def send_step(self, step: Step, now: float) -> None:
        step.epoch = self.epoch
        self.steps.send(encode(step))
        self.group.step_sent(now)

    def say_hello(self, now: float) -> None:
        """Ask the ranks that have not answered this scheduler yet (every ``HELLO_INTERVAL_S``)."""
        if not self.group.ready and now - self._last_hello >= HELLO_INTERVAL_S:
            self.steps.send(encode(Hello(self.epoch, self.group.last_retired)))
            self._last_hello = now

    def receive(self, now: float) -> tuple[list[StepResult], Loss | None]:
        """Everything waiting on the result socket: the step results, and a loss if a message
        revealed one (a rank's new process). Readies and heartbeats go to the group."""
        results: list[StepResult] = []
        while True:
            try:
                frame = self.results.recv(zmq.NOBLOCK)
            except zmq.Again:
                return results, None
            try:
                msg = decode(frame)
            except DecodeError as exc:
                self.log.warning("dropped a bad frame", error=str(exc), num_bytes=len(frame))
                continue
            loss = None
            if isinstance(msg, StepResult):
                results.append(msg)
            elif isinstance(msg, Heartbeat):
                loss = self.group.on_heartbeat(msg, now)
            elif isinstance(msg, ExecutorReady):
                loss = self._on_ready(msg, now)
            if loss is not None:
                return results, loss

    def _on_ready(self, msg: ExecutorReady, now: float) -> Loss | None:
        was_ready = self.group.ready
        loss = self.group.on_ready(msg, self.epoch, now)
        if loss is None and msg.epoch == self.epoch and self.group.accepted(msg.rank, msg.incarnation):
            self.log.info("executor ready", rank=msg.rank, executor_pid=msg.pid, num_blocks=msg.num_blocks,
                          model=msg.model)
            if self.group.ready and not was_ready:
                self.log.info("executor group ready", **self.group.stats)
        return loss

    def report_lost(self, replaced: list[tuple[int, int]], cause: str) -> None:
        """Tell the supervisor (if any) which processes to replace; never blocks."""
        if self.supervisor is None:
            return
        for rank, pid in replaced:
            try:
                self.supervisor.send(encode(ProcessLost("executor", rank, pid, cause)), zmq.NOBLOCK)
            except zmq.Again:
                self.log.warning("the supervisor is not listening; report dropped", rank=rank, pid=pid)

    def shut_down(self, reason: str) -> None:
        try:
            self.steps.send(encode(Shutdown(reason)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass


def _socket(context: zmq.Context, kind: int) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock
