"""``pagedserve serve``: start the scheduler, the executor ranks and the frontend, and supervise them.

Each service is its own process (``python -m services.cli <service> ...``, a ``children.Child``)
wired by ``ipc://`` sockets in a private directory. With ``-tp N`` there are N executor ranks
(``group_layout`` says which run on this host and with which flags). With ``-dp N`` there are N
replicas, each a scheduler and its executor ranks on sockets of their own, and one frontend that
routes requests among them (``data_parallel``); each replica's processes restart on their own
(its scheduler group "scheduler i", its ranks "executor i"), the others serving meanwhile.

A process that dies is started again, its cause logged (how it ended and its last error line) and
counted (``shared.restart_counts``). The executor ranks restart together, as a new group:
tensor-parallel ranks cannot go on without one of theirs, so when any rank ends the others are
stopped, the old group's shared-memory segments and handle store are removed, and every rank
starts again under a fresh group id (and a fresh local rendezvous port when serve chose the first).
A hung executor is found by the scheduler (missed heartbeats, an overdue step), which reports it on
the supervisor socket (``ProcessLost``): the launcher kills it, then restarts it as if it had died.
More than ``--max-restarts`` restarts of one process (the ranks count as one) within
``--restart-window-s`` (``restarts.RestartBudget``), or a configuration error (exit code 2), stops
everything, and ``serve`` exits non-zero naming the process and why; of several ranks that ended,
the one that failed first is named, not those that stopped because it did. On a host without the
scheduler (``--node-rank`` > 0), ranks that end cleanly were stopped by the scheduler: ``serve``
stops and exits 0. SIGTERM or Ctrl-C stops them all, removes the socket directory and any
shared-memory segment of the group.

``--zmq-curve DIR`` (or ``$PAGEDSERVE_ZMQ_CURVE``) hands every child the key directory in its
environment (``shared.zmq_auth``); ``--zmq-curve`` alone makes throw-away keys in the private
socket directory, which goes with it (one host only: across hosts every host needs the same keys).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import threading
import time
import urllib.request

import zmq

from services.children import Child, stop_all
from services.frontend.chat_template import resolve_chat_template
from services.frontend.generation_defaults import check_setting
from services.frontend.flags import HTTP_LIMIT_DESTS
from services.data_parallel import (
    ReplicaPlan, data_parallel_size, frontend_request_endpoint, group_kind, longest_socket_name, plan_replicas,
)
from services.executor.device import check_device_name
from services.group_layout import GroupLayout, check_model_split, layout_from_args
from services.restart_budget import RestartBudget
from shared.endpoints import make_private_socket_dir
from shared.logging import configure_logging
from shared.model_source import resolve_tokenizer
from shared.messages import DecodeError, ProcessLost, decode
from shared.restart_counts import ENV_VAR as RESTARTS_ENV_VAR, restarts_path, write_restart_counts
from shared.zmq_auth import ENV_VAR as CURVE_ENV_VAR, EPHEMERAL, create_keys, curve_dir, load_keys

_SECRET_ENV = ("PAGEDSERVE_API_KEY", "PAGEDSERVE_API_KEY_FILE")  # only the frontend gets these
CONFIG_ERROR_EXIT_CODE = 2  # the command line's code for a bad flag or model: restarting will not help


def serve(args) -> int:
    """Run the services until a signal or a failure that restarts cannot mend; returns the exit code."""
    sock_dir = make_private_socket_dir(longest_socket_name(data_parallel_size(args)))
    try:  # bad group flags, or heads that do not split: a one-line error before anything starts
        if getattr(args, "device", None) is not None:
            check_device_name(args.device)
        plans = plan_replicas(args, sock_dir)
        layout = plans[0].layout
        if layout.world_size > 1:
            check_model_split(args.model, layout.world_size)
        resolve_chat_template(getattr(args, "chat_template", None))  # the frontend reads it again
        check_setting(getattr(args, "generation_config", None) or "auto")
        if getattr(args, "tokenizer", None):
            resolve_tokenizer(args.tokenizer, None)
        curve = zmq_curve_dir(args, layout, sock_dir)
    except BaseException:
        shutil.rmtree(sock_dir, ignore_errors=True)
        raise
    log = configure_logging("launcher")
    for plan in plans:
        _log_group(plan, log)
    if len(plans) > 1:
        log.info("data-parallel replicas", num_replicas=len(plans), tensor_parallel_size=layout.world_size,
                 num_threads_per_rank=plans[0].args.num_threads, seeds=[p.args.seed for p in plans])
    log.info("zmq security", mode="curve" if curve else "plain", key_dir=curve,
             ephemeral_keys=curve is not None and curve.startswith(sock_dir))
    supervisor_endpoint = f"ipc://{os.path.join(sock_dir, 'supervisor.sock')}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PAGEDSERVE_SUPERVISOR_ENDPOINT": supervisor_endpoint, RESTARTS_ENV_VAR: restarts_path(sock_dir),
           **({CURVE_ENV_VAR: curve} if curve else {})}
    env.setdefault("PAGEDSERVE_LOG_FORMAT", "console" if sys.stderr.isatty() else "json")
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum, _frame):
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    context = zmq.Context()
    reports = context.socket(zmq.PULL)
    reports.setsockopt(zmq.LINGER, 0)
    reports.bind(supervisor_endpoint)
    supervisor = _Supervisor(args, plans, sock_dir, env, reports, log)
    code, failure = 0, None
    try:
        supervisor.start_all()
        code, failure = supervisor.run(stop)
    finally:
        if received:
            log.info("stopping", signal=received[0])
        stop_all(list(supervisor.children()))
        context.destroy(linger=0)
        shutil.rmtree(sock_dir, ignore_errors=True)
        for plan in supervisor.plans.values():
            _remove_group_segments(plan.layout, log)
    if failure is not None:
        log.error("stopped", why=failure)
        print(f"pagedserve: {failure}; stopped the others", file=sys.stderr)
    return code


class _Supervisor:
    """This host's processes by group (``scheduler``, ``executor``: the local ranks, ``frontend``),
    and what to do when one ends."""

    def __init__(self, args, plans: list[ReplicaPlan], sock_dir: str, env: dict[str, str], reports: zmq.Socket,
                 log) -> None:
        self.args, self.sock_dir, self.reports, self.log = args, sock_dir, reports, log
        self.runs_scheduler = plans[0].layout.runs_scheduler
        self.budget = RestartBudget(_given(args, "max_restarts", 5), _given(args, "restart_window_s", 600.0))
        self.groups = _build_groups(args, plans, env)
        # the executor group of each replica, by its supervisor group's name
        self.plans = {plan.group("executor"): plan for plan in plans}
        self._followers_seen: dict[str, float] = {}  # group -> when a follower was first seen ended

    def children(self):
        return (child for children in self.groups.values() for child in children)

    def _follower_grace_over(self, name: str, children: list[Child]) -> bool:
        """Whether the group ``name`` has waited ``FOLLOWER_GRACE_S`` since one of its processes
        was first seen stopped for another's failure (``first_ended``)."""
        if not any(c.followed for c in children if c.proc is not None and not c.running):
            return True
        since = self._followers_seen.setdefault(name, time.monotonic())
        return time.monotonic() - since >= FOLLOWER_GRACE_S

    def start_all(self) -> None:
        self._write_restart_counts()
        for child in self.children():
            child.start(self.log)

    def _write_restart_counts(self) -> None:
        """For /metrics and /health: only the launcher sees a process killed before others heard of it."""
        counts: dict[str, int] = {}  # by kind of process: the replicas' summed
        for name in self.groups:
            counts[group_kind(name)] = counts.get(group_kind(name), 0) + self.budget.num_restarts[name]
        write_restart_counts(restarts_path(self.sock_dir), counts)

    def run(self, stop: threading.Event) -> tuple[int, str | None]:
        """Restart what ends until ``stop``; returns (exit code, why it gave up or None)."""
        url = f"http://{self.args.host}:{self.args.port}"
        announced = not self.runs_scheduler
        while not stop.is_set():
            self._kill_reported()
            for name, children in self.groups.items():
                ended = first_ended(children, grace_over=self._follower_grace_over(name, children))
                if ended is not None:
                    self._followers_seen.pop(name, None)
                    if (verdict := self._restart(name, children, ended)) is not None:
                        return verdict
            if not announced and _healthy(url):
                announced = True
                self.log.info("pagedserve ready", url=url, model=self.args.model or "SmolLM2-135M-Instruct")
            stop.wait(0.2)
        return 0, None

    def _restart(self, name: str, children: list[Child], ended: Child) -> tuple[int, str | None] | None:
        """Restart ``ended``'s group whole; or, when that cannot help, (exit code, why)."""
        why = ended.why()
        code = ended.proc.returncode
        if code == 0 and not ended.lost_cause and not self.runs_scheduler:
            self.log.info("the scheduler stopped the group", rank=ended.name)  # its Shutdown reached this host
            return 0, None
        if code == CONFIG_ERROR_EXIT_CODE and not ended.lost_cause:
            return CONFIG_ERROR_EXIT_CODE, f"the {ended.name} process {why}"
        last = why if len(children) == 1 else f"{ended.name} {why}"
        if not self.budget.allow(name, time.monotonic()):
            return 1, f"{self.budget.refusal(name)}; last: {last}"
        self.log.warning("process restarted", service=name, rank=ended.rank, cause=last,
                         num_restarts=self.budget.num_restarts[name])
        self._write_restart_counts()
        stop_all([c for c in children if c.running])  # a group restarts whole
        if name in self.plans:
            self._renew_group(name, children)
        for child in children:
            child.start(self.log)
        return None

    def _renew_group(self, name: str, ranks: list[Child]) -> None:
        """The stopped ranks' leftovers go (segments of killed ranks, the handle store); the new
        ranks meet as a new group, so nothing of the old one can be mistaken for theirs."""
        plan = self.plans[name]
        if plan.layout.world_size == 1:
            return
        _remove_group_segments(plan.layout, self.log)
        try:
            os.unlink(plan.layout.store_path)
        except FileNotFoundError:
            pass
        layout = layout_from_args(plan.args, self.sock_dir, os.path.basename(plan.layout.store_path))
        plan = self.plans[name] = dataclasses.replace(plan, layout=layout)
        _log_group(plan, self.log)
        for child in ranks:
            child.argv = rank_argv(plan, child.rank)

    def _kill_reported(self) -> None:
        """Kill the processes the scheduler reported lost (hung), if they still run; ``run`` then
        restarts them."""
        while True:
            try:
                msg = decode(self.reports.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            except DecodeError:
                continue
            if not isinstance(msg, ProcessLost):
                continue
            for child in (c for name, children in self.groups.items() if group_kind(name) == msg.process
                          for c in children):  # the pid tells the replicas apart
                if child.rank == msg.rank and child.running and child.proc.pid == msg.pid:
                    self.log.warning("killing a lost process", service=child.name, rank=msg.rank, child_pid=msg.pid,
                                     cause=msg.cause)
                    child.kill(msg.cause)


def zmq_curve_dir(args, layout: GroupLayout, sock_dir: str) -> str | None:
    """The CURVE key directory every child gets (None: plain ZeroMQ), its keys checked now: a
    missing one stops serve before anything starts. ``--zmq-curve`` alone: fresh keys in ``sock_dir``."""
    directory = curve_dir(args)
    if directory == EPHEMERAL:
        if layout.num_nodes > 1:
            raise ValueError(f"--zmq-curve needs a key directory with --nnodes {layout.num_nodes}: every host must "
                             "hold the same keys (make them once with `pagedserve keys --out DIR`, copy DIR)")
        directory = os.path.join(sock_dir, "zmq-curve")
        create_keys(directory)
    if directory:
        for role in ("scheduler", "frontend", "executor") if layout.runs_scheduler else ("executor",):
            load_keys(directory, role)
    return directory


def _build_groups(args, plans: list[ReplicaPlan], env: dict[str, str]) -> dict[str, list[Child]]:
    """This host's processes by supervisor group, not yet started: each replica's scheduler and
    executor ranks, then the frontend. Only the frontend sees the API key (in its environment);
    the engine processes get none of the secrets."""
    engine_env = {k: v for k, v in env.items() if k not in _SECRET_ENV}
    groups: dict[str, list[Child]] = {}
    for plan in plans:
        layout, own_env = plan.layout, {**engine_env, **plan.endpoints.to_env(), **plan.health_env(engine_env)}
        ranks = [Child(plan.child_name("executor" if layout.world_size == 1 else f"executor rank {rank}"),
                       rank_argv(plan, rank), own_env,
                       command="executor", rank=rank)
                 for rank in layout.local_ranks]
        if layout.runs_scheduler:
            groups[plan.group("scheduler")] = [Child(plan.child_name("scheduler"),
                                                     scheduler_argv(args) + layout.scheduler_argv(), own_env,
                                                     command="scheduler")]
        groups[plan.group("executor")] = ranks
    if plans[0].layout.runs_scheduler:
        endpoints = {**plans[0].endpoints.to_env(), "PAGEDSERVE_REQUEST_ENDPOINT": frontend_request_endpoint(plans)}
        groups["frontend"] = [Child("frontend", frontend_argv(args), frontend_env(args, {**env, **endpoints}))]
    return groups


# seconds a group whose only ended ranks stopped for another's failure waits for that one to be
# seen ended too (a killed rank takes a moment to be reaped; its peers may notice sooner)
FOLLOWER_GRACE_S = 2.0


def first_ended(children: list[Child], grace_over: bool = True) -> Child | None:
    """A process that has ended, preferring one that did not stop because another failed first.
    Unless ``grace_over``: None while every one that ended is such a follower and others still
    run, so that the one that failed first is named once it is reaped (seen: a rank killed by
    SIGKILL not yet reaped when a peer rank had already stopped for it)."""
    ended = [c for c in children if not c.running]
    cause = next((c for c in ended if not c.followed), None)
    if cause is not None or not ended:
        return cause
    if not grace_over and len(ended) < len(children):
        return None
    return ended[0]


def _log_group(plan: ReplicaPlan, log) -> None:
    layout = plan.layout
    if layout.world_size > 1:
        replica = {"replica": plan.index} if plan.count > 1 else {}
        log.info("executor group", **replica, world_size=layout.world_size, all_reduce=layout.all_reduce,
                 num_nodes=layout.num_nodes, node_rank=layout.node_rank, ranks=list(layout.local_ranks),
                 group_id=layout.group_id, dist_init_addr=layout.dist_init_addr)


def _remove_group_segments(layout: GroupLayout, log) -> None:
    """The ranks unlink their segments themselves; this catches a group killed while connecting."""
    if layout.world_size == 1:
        return
    from services.executor.parallel.segment import cleanup_group

    removed = cleanup_group(layout.group_id)
    if removed:
        log.info("removed the group's shared-memory segments", names=removed)


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
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):  # a --flag / --no-flag switch (argparse.BooleanOptionalAction)
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def scheduler_argv(args) -> list[str]:
    argv = _flags(args, ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "preemption_mode",
                         "kv_policy", "step_timeout", "heartbeat_timeout", "async_scheduling",
                         "plan_ahead_at"])
    return argv + (["--no-prefix-caching"] if args.enable_prefix_caching is False else [])


def rank_argv(plan: ReplicaPlan, rank: int) -> list[str]:
    """Executor rank ``rank``'s flags: serve's, its group's, and its GPU's place where not its rank."""
    index = plan.device_index(rank)
    return (executor_argv(plan.args) + plan.layout.executor_argv(rank, plan.args.num_threads)
            + ([] if index == rank else ["--device-index", str(index)]))


def executor_argv(args) -> list[str]:
    return _flags(args, ["model", "tokenizer", "dtype", "device", "block_size", "num_kv_blocks", "kv_cache_memory",
                         "swap_space", "max_model_len", "attention_backend", "linear_kernel", "num_threads",
                         "adaptive_threads", "seed"])


def frontend_argv(args) -> list[str]:
    argv = _flags(args, ["model", "tokenizer", "served_model_name", "chat_template", "generation_config", "host",
                         "port", "max_model_len", "max_queue_len", "heartbeat_timeout", *HTTP_LIMIT_DESTS])
    return argv + ([] if getattr(args, "playground", True) else ["--no-playground"])


def frontend_env(args, env: dict[str, str]) -> dict[str, str]:
    """The API key goes to the frontend in its environment: an argv is readable by every user."""
    return {**env, "PAGEDSERVE_API_KEY": args.api_key} if args.api_key else env
