"""The launcher's supervisor: this host's processes by group, started, watched and restarted.

``build_groups`` makes the processes (``children.Child``) of every replica from serve's flags;
``Supervisor.run`` restarts what ends, a group whole, within the restart budget
(``--max-restarts`` within ``--restart-window-s``), and kills what the scheduler reports lost.
``services.launcher`` has the whole story; this module is its loop.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import urllib.request

import zmq

from services.children import Child, stop_all
from services.command_flags import frontend_argv, frontend_env, rank_argv, scheduler_argv
from services.data_parallel import ReplicaPlan, frontend_request_endpoint, group_kind
from services.group_layout import GroupLayout, layout_from_args
from services.restart_budget import RestartBudget
from shared.engine_flags import SupervisorFlags
from shared.flag_spec import from_args
from shared.messages import DecodeError, ProcessLost, decode
from shared.restart_counts import restarts_path, write_restart_counts

_SECRET_ENV = ("PAGEDSERVE_API_KEY", "PAGEDSERVE_API_KEY_FILE")  # only the frontend gets these
CONFIG_ERROR_EXIT_CODE = 2  # the command line's code for a bad flag or model: restarting will not help


class Supervisor:
    """This host's processes by group (``scheduler``, ``executor``: the local ranks, ``frontend``),
    and what to do when one ends."""

    def __init__(self, args, plans: list[ReplicaPlan], sock_dir: str, env: dict[str, str], reports: zmq.Socket,
                 log) -> None:
        self.args, self.sock_dir, self.reports, self.log = args, sock_dir, reports, log
        self.runs_scheduler = plans[0].layout.runs_scheduler
        limits = from_args(args, SupervisorFlags)
        self.budget = RestartBudget(limits.max_restarts, limits.restart_window_s)
        self.groups = build_groups(args, plans, env)
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
        remove_group_segments(plan.layout, self.log)
        try:
            os.unlink(plan.layout.store_path)
        except FileNotFoundError:
            pass
        layout = layout_from_args(plan.args, self.sock_dir, os.path.basename(plan.layout.store_path))
        plan = self.plans[name] = dataclasses.replace(plan, layout=layout)
        log_group(plan, self.log)
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


def build_groups(args, plans: list[ReplicaPlan], env: dict[str, str]) -> dict[str, list[Child]]:
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
                                                     scheduler_argv(args) + layout.scheduler_argv()
                                                     + plan.scheduler_argv(), own_env,
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


def log_group(plan: ReplicaPlan, log) -> None:
    layout = plan.layout
    if layout.world_size > 1:
        replica = {"replica": plan.index} if plan.count > 1 else {}
        log.info("executor group", **replica, world_size=layout.world_size, all_reduce=layout.all_reduce,
                 num_nodes=layout.num_nodes, node_rank=layout.node_rank, ranks=list(layout.local_ranks),
                 group_id=layout.group_id, dist_init_addr=layout.dist_init_addr)


def remove_group_segments(layout: GroupLayout, log) -> None:
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
