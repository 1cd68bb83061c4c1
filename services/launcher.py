"""``pagedserve serve``: start the scheduler, the executor and the frontend, and supervise them.

Each service is its own process (``python -m services.cli <service> ...``) wired by ``ipc://``
sockets in a private directory. A process that dies is started again, its cause logged (how it
ended and its last error line) and counted; the executor ranks restart together (tensor-parallel
ranks block in collectives when one is gone). A hung executor is found by the scheduler (missed
heartbeats, an overdue step), which reports it on the supervisor socket (``ProcessLost``): the
launcher kills it, then restarts it as if it had died. More than ``--max-restarts`` restarts of one
process within ``--restart-window-s`` (``restarts.RestartBudget``), or a configuration error (exit
code 2), stops everything, and ``serve`` exits non-zero naming the process and why. SIGTERM or
Ctrl-C stops all of them and removes the socket directory.
"""

from __future__ import annotations

import collections
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import zmq

from services.restarts import RestartBudget
from shared.endpoints import Endpoints, make_private_socket_dir
from shared.logging import configure_logging
from shared.messages import DecodeError, ProcessLost, decode

STOP_TIMEOUT_S = 5.0
CONFIG_ERROR_EXIT_CODE = 2  # pagedserve's exit code for a bad flag or model: restarting will not help
_PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    """Own session (Ctrl-C reaches only the launcher) and die with the launcher if it is killed."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class _Child:
    """One supervised process; ``start`` (re)starts it with the same command line."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], rank: int = 0) -> None:
        self.name = name
        self.rank = rank
        self.argv = argv
        self.env = env
        self.lost_cause: str | None = None  # why the launcher killed it, when it did
        self.proc: subprocess.Popen | None = None

    def start(self, log) -> None:
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.lost_cause = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", self.name, *self.argv], env=self.env, stdin=subprocess.DEVNULL,
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
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def why(self) -> str:
        rc = self.proc.returncode
        cause = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
        if self.lost_cause:
            cause = f"{self.lost_cause}; it was killed"
        self._pump.join(timeout=1.0)
        errors = [line for line in self.tail if "error" in line.lower()]
        last = errors[-1] if errors else (self.tail[-1] if self.tail else "")
        return f"{cause}; last output: {last.strip()[:500]}" if last else cause


def serve(args) -> int:
    """Run the services until a signal or a failure that restarts cannot mend; returns the exit code."""
    log = configure_logging("launcher")
    sock_dir = make_private_socket_dir()
    endpoints = Endpoints.in_directory(sock_dir)
    supervisor_endpoint = f"ipc://{os.path.join(sock_dir, 'supervisor.sock')}"
    env = {**os.environ, **endpoints.to_env(), "PYTHONUNBUFFERED": "1",
           "PAGEDSERVE_SUPERVISOR_ENDPOINT": supervisor_endpoint}
    env.setdefault("PAGEDSERVE_LOG_FORMAT", "console" if sys.stderr.isatty() else "json")
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum, _frame):
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    budget = RestartBudget(_given(args, "max_restarts", 5), _given(args, "restart_window_s", 600.0))
    context = zmq.Context()
    reports = context.socket(zmq.PULL)
    reports.setsockopt(zmq.LINGER, 0)
    reports.bind(supervisor_endpoint)
    groups = {"scheduler": [_Child("scheduler", scheduler_argv(args), env)],
              "executor": [_Child("executor", executor_argv(args), env)],
              "frontend": [_Child("frontend", frontend_argv(args), env)]}
    failure = None
    try:
        for child in _all(groups):
            child.start(log)
        failure = _supervise(groups, reports, budget, stop, log, f"http://{args.host}:{args.port}", args)
    finally:
        if received:
            log.info("stopping", signal=received[0])
        _stop_all(list(_all(groups)))
        context.destroy(linger=0)
        shutil.rmtree(sock_dir, ignore_errors=True)
    if failure is not None:
        log.error("stopped", why=failure)
        print(f"pagedserve: {failure}; stopped the others", file=sys.stderr)
        return 1
    return 0


def _supervise(groups: dict[str, list[_Child]], reports: zmq.Socket, budget: RestartBudget, stop: threading.Event,
               log, url: str, args) -> str | None:
    """Restart what dies until ``stop``; returns why it gave up (None: stopped by a signal)."""
    announced = False
    while not stop.is_set():
        _kill_reported(groups, reports, log)
        for name, children in groups.items():
            dead = next((c for c in children if not c.running), None)
            if dead is None:
                continue
            why = dead.why()
            if dead.proc.returncode == CONFIG_ERROR_EXIT_CODE and not dead.lost_cause:
                return f"the {name} process {why}"
            if not budget.allow(name, time.monotonic()):
                return f"{budget.refusal(name)}; last: {why}"
            log.warning("process restarted", service=name, rank=dead.rank, cause=why,
                        num_restarts=budget.num_restarts[name])
            _stop_all([c for c in children if c.running])  # a group restarts whole
            for child in children:
                child.start(log)
        if not announced and _healthy(url):
            announced = True
            log.info("pagedserve ready", url=url, model=args.model or "SmolLM2-135M-Instruct")
        stop.wait(0.2)
    return None


def _kill_reported(groups: dict[str, list[_Child]], reports: zmq.Socket, log) -> None:
    """Kill the processes the scheduler reported lost (hung), if they still run; the loop restarts them."""
    while True:
        try:
            msg = decode(reports.recv(zmq.NOBLOCK))
        except zmq.Again:
            return
        except DecodeError:
            continue
        if not isinstance(msg, ProcessLost) or msg.process not in groups:
            continue
        for child in groups[msg.process]:
            if child.rank == msg.rank and child.running and child.proc.pid == msg.pid:
                log.warning("killing a lost process", service=msg.process, rank=msg.rank, child_pid=msg.pid,
                            cause=msg.cause)
                child.lost_cause = msg.cause
                child.proc.kill()
                child.proc.wait()


def _all(groups: dict[str, list[_Child]]):
    return (child for children in groups.values() for child in children)


def _stop_all(children: list[_Child]) -> None:
    for child in children:
        if child.running:
            child.proc.send_signal(signal.SIGTERM)
            child.proc.send_signal(signal.SIGCONT)  # a stopped process must run to end
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for child in children:
        if child.proc is None:
            continue
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=0.5) as resp:
            return resp.status == 200
    except OSError:
        return False


def _given(args, name: str, default):
    value = getattr(args, name, None)
    return default if value is None else value


def _flags(args, names: list[str]) -> list[str]:
    argv = []
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def scheduler_argv(args) -> list[str]:
    argv = _flags(args, ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "preemption_mode",
                         "kv_policy", "step_timeout", "heartbeat_timeout"])
    return argv + (["--no-prefix-caching"] if args.enable_prefix_caching is False else [])


def executor_argv(args) -> list[str]:
    return _flags(args, ["model", "dtype", "block_size", "num_kv_blocks", "kv_cache_memory",
                         "swap_space", "max_model_len", "attention_backend", "num_threads", "seed"])


def frontend_argv(args) -> list[str]:
    return _flags(args, ["model", "served_model_name", "host", "port", "max_model_len", "max_queue_len", "api_key",
                         "heartbeat_timeout"])
