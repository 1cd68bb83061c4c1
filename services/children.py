"""The processes ``pagedserve serve`` supervises: start one (again), say why it ended, stop several.

Each child runs ``python -m services.cli <command> ...`` in its own session (Ctrl-C reaches only
the launcher) and dies with the launcher if that is killed. Its stderr is forwarded line by line,
and the last lines are kept to say why it ended.
"""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

from services.executor.main import EXIT_PEER_FAILED, EXIT_RETIRED

STOP_TIMEOUT_S = 5.0
_PR_SET_PDEATHSIG = 1

__all__ = ["EXIT_PEER_FAILED", "EXIT_RETIRED", "Child", "stop_all"]


def _child_setup() -> None:
    """Own session (Ctrl-C reaches only the launcher) and die with the launcher if it is killed."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Child:
    """One supervised process; ``start`` (re)starts it with its current ``argv``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], command: str | None = None,
                 rank: int = 0) -> None:
        self.name = name  # "executor rank 1" runs the command "executor"
        self.command = command or name
        self.rank = rank
        self.argv = argv
        self.env = env
        self.lost_cause: str | None = None  # why the launcher killed it, when it did
        self.proc: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=20)

    def start(self, log) -> None:
        self.tail = collections.deque(maxlen=20)
        self.lost_cause = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", self.command, *self.argv], env=self.env, stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE, preexec_fn=_child_setup, text=True, errors="replace",
        )
        self._pump = threading.Thread(target=self._forward_stderr, args=(self.proc, self.tail), daemon=True)
        self._pump.start()
        log.info("process started", service=self.name, rank=self.rank, child_pid=self.proc.pid)

    @staticmethod
    def _forward_stderr(proc: subprocess.Popen, tail: collections.deque[str]) -> None:
        for line in proc.stderr:
            tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()

    @property
    def followed(self) -> bool:
        """It ended because another process failed first (a peer rank, or the scheduler gave its
        group up): that one should be named, not this."""
        return self.command == "executor" and self.proc.returncode in (EXIT_PEER_FAILED, EXIT_RETIRED)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, cause: str) -> None:
        """Kill it now (it hung: ``cause`` says how), and wait for it."""
        self.lost_cause = cause
        self.proc.kill()
        self.proc.wait()

    def why(self) -> str:
        """How it ended, and its last error line (or last line)."""
        rc = self.proc.returncode
        cause = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
        if rc == EXIT_PEER_FAILED and self.command == "executor":
            cause = "stopped because another rank of its group failed"
        if rc == EXIT_RETIRED and self.command == "executor":
            cause = "stopped because the scheduler gave its group up"
        if self.lost_cause:
            cause = f"{self.lost_cause}; it was killed"
        self._pump.join(timeout=1.0)
        errors = [line for line in self.tail if "error" in line.lower() or line.startswith("pagedserve ")]
        last = errors[-1] if errors else (self.tail[-1] if self.tail else "")
        return f"{cause}; last output: {last.strip()[:500]}" if last else cause


def stop_all(children: list[Child]) -> None:
    """SIGTERM each running child (and SIGCONT: a stopped one must run to end), wait up to
    ``STOP_TIMEOUT_S`` in all, then kill what is left."""
    for child in children:
        if child.running:
            child.proc.send_signal(signal.SIGTERM)
            child.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for child in children:
        if child.proc is None:
            continue
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
