"""``pagedserve serve``: start the scheduler, the executor ranks and the frontend, and supervise them.

Each service is its own process (``python -m services.cli <service> ...``) wired by ``ipc://``
sockets in a private directory. With ``-tp N`` there are N executor ranks (``group_layout`` says
which run on this host and with which flags). If any process exits, the others are stopped and
``serve`` exits non-zero naming it and why; of several ranks that ended, the one that failed
first is named, not those that stopped because it did. SIGTERM or Ctrl-C stops them all, removes
the socket directory and any shared-memory segment of the group.
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

from services.executor.main import EXIT_PEER_FAILED
from services.group_layout import GroupLayout, check_model_split, layout_from_args
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
    def __init__(self, name: str, argv: list[str], env: dict[str, str], command: str | None = None) -> None:
        self.name = name  # "executor rank 1" runs the command "executor"
        self.tail: collections.deque[str] = collections.deque(maxlen=20)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", command or name, *argv], env=env, stdin=subprocess.DEVNULL,
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
        if rc == EXIT_PEER_FAILED and self.name.startswith("executor"):
            cause = "stopped because another rank of its group failed"
        self._pump.join(timeout=1.0)
        errors = [line for line in self.tail if "error" in line.lower() or line.startswith("pagedserve ")]
        last = errors[-1] if errors else (self.tail[-1] if self.tail else "")
        return f"{cause}; last output: {last.strip()[:500]}" if last else cause


def serve(args) -> int:
    """Run the services until a signal or a failure; returns the exit code."""
    sock_dir = make_private_socket_dir()
    try:  # bad group flags, or heads that do not split: a one-line error before anything starts
        layout = layout_from_args(args, sock_dir)
        if layout.world_size > 1:
            check_model_split(args.model, layout.world_size)
    except BaseException:
        shutil.rmtree(sock_dir, ignore_errors=True)
        raise
    log = configure_logging("launcher")
    if layout.world_size > 1:
        log.info("executor group", world_size=layout.world_size, all_reduce=layout.all_reduce,
                 num_nodes=layout.num_nodes, node_rank=layout.node_rank, ranks=list(layout.local_ranks),
                 group_id=layout.group_id, dist_init_addr=layout.dist_init_addr)
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
        _start_children(children, args, layout, env)
        url = f"http://{args.host}:{args.port}"
        announced = not layout.runs_scheduler
        while not stop.is_set():
            failed = _first_ended(children)
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
        _remove_group_segments(layout, log)
    if failed is not None and failed.proc.returncode == 0 and not layout.runs_scheduler:
        log.info("the scheduler stopped the group", rank=failed.name)  # a Shutdown reached this host's ranks
        return 0
    if failed is not None:
        message = f"pagedserve: the {failed.name} process {failed.why()}; stopped the others"
        log.error("service died", service=failed.name, why=failed.why())
        print(message, file=sys.stderr)
        return CONFIG_ERROR_EXIT_CODE if failed.proc.returncode == CONFIG_ERROR_EXIT_CODE else 1
    return 0


def _start_children(children: list[_Child], args, layout: GroupLayout, env: dict[str, str]) -> None:
    """Start this host's processes, appending each to ``children`` as it starts. Only the frontend
    sees the API key (in its environment); the engine processes get none of the secrets."""
    engine_env = {k: v for k, v in env.items() if k not in _SECRET_ENV}
    if layout.runs_scheduler:
        children.append(_Child("scheduler", scheduler_argv(args) + layout.scheduler_argv(), engine_env))
    for rank in layout.local_ranks:
        name = "executor" if layout.world_size == 1 else f"executor rank {rank}"
        argv = executor_argv(args) + layout.executor_argv(rank, args.num_threads)
        children.append(_Child(name, argv, engine_env, command="executor"))
    if layout.runs_scheduler:
        children.append(_Child("frontend", frontend_argv(args), frontend_env(args, env)))


def _first_ended(children: list[_Child]) -> _Child | None:
    """A process that has ended, preferring one that did not stop because a peer rank failed."""
    ended = [c for c in children if c.proc.poll() is not None]
    return next((c for c in ended if c.proc.returncode != EXIT_PEER_FAILED), ended[0] if ended else None)


def _remove_group_segments(layout: GroupLayout, log) -> None:
    """The ranks unlink their segments themselves; this catches a group killed while connecting."""
    if layout.world_size == 1:
        return
    from services.executor.parallel.segment import cleanup_group

    removed = cleanup_group(layout.group_id)
    if removed:
        log.info("removed the group's shared-memory segments", names=removed)


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
