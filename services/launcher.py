"""``pagedserve serve``: start the scheduler, the executor and the frontend, and supervise them.

Each service is its own process (``python -m services.cli <service> ...``) wired by ``ipc://``
sockets in a private directory. If any of them exits, the others are stopped and ``serve`` exits
non-zero naming it and why. SIGTERM or Ctrl-C stops all three and removes the socket directory.
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

from services.frontend.http_limits import HTTP_LIMIT_DESTS
from shared.endpoints import Endpoints, make_private_socket_dir
from shared.logging import configure_logging

STOP_TIMEOUT_S = 5.0
_PR_SET_PDEATHSIG = 1
_SECRET_ENV = ("PAGEDSERVE_API_KEY", "PAGEDSERVE_API_KEY_FILE")  # only the frontend gets these
CONFIG_ERROR_EXIT_CODE = 2  # the command line's code for a bad flag or model: ``serve`` passes it on


def _child_setup() -> None:
    """Own session (Ctrl-C reaches only the launcher) and die with the launcher if it is killed."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class _Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", name, *argv], env=env, stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE, preexec_fn=_child_setup, text=True, errors="replace",
        )
        self._pump = threading.Thread(target=self._forward_stderr, daemon=True)
        self._pump.start()

    def _forward_stderr(self) -> None:
        for line in self.proc.stderr:
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()

    def why(self) -> str:
        rc = self.proc.returncode
        cause = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
        self._pump.join(timeout=1.0)
        errors = [line for line in self.tail if "error" in line.lower() or line.startswith("pagedserve ")]
        last = errors[-1] if errors else (self.tail[-1] if self.tail else "")
        return f"{cause}; last output: {last.strip()[:500]}" if last else cause


def serve(args) -> int:
    """Run the three services until a signal or a failure; returns the exit code."""
    log = configure_logging("launcher")
    sock_dir = make_private_socket_dir()
    endpoints = Endpoints.in_directory(sock_dir)
    env = {**os.environ, **endpoints.to_env(), "PYTHONUNBUFFERED": "1"}
    env.setdefault("PAGEDSERVE_LOG_FORMAT", "console" if sys.stderr.isatty() else "json")
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum, _frame):
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    children: list[_Child] = []
    failed: _Child | None = None
    try:
        engine_env = {k: v for k, v in env.items() if k not in _SECRET_ENV}
        children.append(_Child("scheduler", scheduler_argv(args), engine_env))
        children.append(_Child("executor", executor_argv(args), engine_env))
        children.append(_Child("frontend", frontend_argv(args), frontend_env(args, env)))
        url = f"http://{args.host}:{args.port}"
        announced = False
        while not stop.is_set():
            failed = next((c for c in children if c.proc.poll() is not None), None)
            if failed is not None:
                break
            if not announced and _healthy(url):
                announced = True
                log.info("pagedserve ready", url=url, model=args.model or "SmolLM2-135M-Instruct")
            stop.wait(0.2)
    finally:
        if received:
            log.info("stopping", signal=received[0])
        _stop_all(children)
        shutil.rmtree(sock_dir, ignore_errors=True)
    if failed is not None:
        message = f"pagedserve: the {failed.name} process {failed.why()}; stopped the others"
        log.error("service died", service=failed.name, why=failed.why())
        print(message, file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE if failed.proc.returncode == CONFIG_ERROR_EXIT_CODE else 1
    return 0


def _stop_all(children: list[_Child]) -> None:
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for child in children:
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


def _flags(args, names: list[str]) -> list[str]:
    argv = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def scheduler_argv(args) -> list[str]:
    argv = _flags(args, ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "preemption_mode",
                         "kv_policy"])
    return argv + (["--no-prefix-caching"] if args.enable_prefix_caching is False else [])


def executor_argv(args) -> list[str]:
    return _flags(args, ["model", "dtype", "block_size", "num_kv_blocks", "kv_cache_memory",
                         "swap_space", "max_model_len", "attention_backend", "num_threads", "seed"])


def frontend_argv(args) -> list[str]:
    argv = _flags(args, ["model", "served_model_name", "host", "port", "max_model_len", "max_queue_len",
                         *HTTP_LIMIT_DESTS])
    return argv + ([] if getattr(args, "playground", True) else ["--no-playground"])


def frontend_env(args, env: dict[str, str]) -> dict[str, str]:
    """The API key goes to the frontend in its environment: an argv is readable by every user."""
    return {**env, "PAGEDSERVE_API_KEY": args.api_key} if args.api_key else env
