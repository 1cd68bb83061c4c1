"""How ``pagedserve serve -dp N`` lays out N data-parallel replicas on this host: plain data, no
processes (``launcher`` starts them).

Each replica is a whole engine: its own scheduler (block tables, prefix cache, swap space) and its
own executor group (``-tp`` ranks holding the whole model between them and a KV pool of
``--kv-cache-memory``), reached through sockets of its own (``r<i>-request.sock`` and so on in the
launcher's private directory). The one frontend is given every replica's request endpoint and routes
each request to one of them (``services.frontend.replicas``). With one replica the names are the
ones serve always used (``scheduler``, ``executor``, the directory's ``request.sock``...).

Threads: without ``--num-threads`` (or ``PAGEDSERVE_NUM_THREADS``, each rank's) the executor
threads serve would give one group are shared among the replicas (``shared.cpu_threads.choose_threads``,
then split over replicas and ranks, rounded down), at least one each. Seeds: replica ``i`` draws the random numbers of
requests that give no seed from ``--seed + i`` (two replicas must not sample alike).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from services.group_layout import GroupLayout, layout_from_args
from shared import kv_events_config
from shared.endpoints import Endpoints
from shared.engine_flags import RunnerFlags

DEFAULT_SEED = RunnerFlags().seed  # the executor's, when --seed is not given


@dataclass(frozen=True)
class ReplicaPlan:
    index: int
    count: int
    endpoints: Endpoints
    layout: GroupLayout
    args: argparse.Namespace  # serve's flags as this replica's processes take them

    def group(self, kind: str) -> str:
        """The supervisor's name for this replica's ``kind`` ("scheduler", "executor") of processes."""
        return kind if self.count == 1 else f"{kind} {self.index}"

    def child_name(self, what: str) -> str:
        """A process's name in logs and errors."""
        return what if self.count == 1 else f"replica {self.index} {what}"

    def device_index(self, rank: int) -> int:
        """Executor rank ``rank``'s place among this host's ranks of every replica (its
        ``--device-index``): replica i's ranks come after replica i - 1's, so that ``--device cuda``
        spreads them over the host's GPUs (``services/executor/device.py``)."""
        local = self.layout.local_ranks
        return self.index * len(local) + rank - local.start

    def scheduler_argv(self) -> list[str]:
        """This replica's scheduler's own flags: its index (for its KV cache events' rank and ports)."""
        return [] if self.count == 1 else ["--data-parallel-rank", str(self.index)]

    def health_env(self, env: dict[str, str]) -> dict[str, str]:
        """Heartbeat files (``$PAGEDSERVE_HEALTH_DIR``, set in the image): each replica's in a
        directory of its own, ``replica-<i>`` (every replica has a scheduler and a rank 0)."""
        directory = env.get("PAGEDSERVE_HEALTH_DIR")
        if self.count == 1 or not directory:
            return {}
        return {"PAGEDSERVE_HEALTH_DIR": os.path.join(directory, f"replica-{self.index}")}


def group_kind(group: str) -> str:
    """``"executor 1"`` -> ``"executor"``: the process kind a supervisor group holds."""
    return group.split(" ", 1)[0]


def data_parallel_size(args) -> int:
    """``-dp``, validated (``ValueError`` naming the flag)."""
    size = getattr(args, "data_parallel_size", None)
    size = 1 if size is None else size
    if size < 1:
        raise ValueError(f"-dp/--data-parallel-size must be at least 1, got {size}")
    if size > 1 and (args.num_nodes or 1) > 1:
        raise ValueError("-dp/--data-parallel-size > 1 runs on one host; it does not combine with --nnodes")
    if size > 1 and args.dist_init_addr:
        raise ValueError("--dist-init-addr names one rendezvous, and with -dp/--data-parallel-size > 1 every "
                         "replica's ranks meet on their own: leave it out")
    return size


def plan_replicas(args, sock_dir: str) -> list[ReplicaPlan]:
    """Every replica's endpoints, executor group and flags (``ValueError`` naming a bad flag)."""
    count = data_parallel_size(args)
    kv_events_config.check_replicas(getattr(args, "kv_events_config", None), count)
    if count == 1:
        return [ReplicaPlan(0, 1, Endpoints.in_directory(sock_dir), layout_from_args(args, sock_dir), args)]
    threads = _threads_per_rank(args, count)
    plans = []
    for index in range(count):
        own = argparse.Namespace(**vars(args))
        if threads is not None:
            own.num_threads = threads
        own.seed = (DEFAULT_SEED if args.seed is None else args.seed) + index
        layout = layout_from_args(own, sock_dir, store_name=f"r{index}-group-store")
        endpoints = Endpoints.in_directory(sock_dir, prefix=replica_prefix(index))
        plans.append(ReplicaPlan(index, count, endpoints, layout, own))
    return plans


def replica_prefix(index: int) -> str:
    """The socket file names' prefix of replica ``index`` (with more than one)."""
    return f"r{index}-"


def longest_socket_name(count: int) -> str:
    """The longest socket file name ``count`` replicas put in the launcher's directory."""
    return "" if count == 1 else f"{replica_prefix(count - 1)}{max(Endpoints.names(), key=len)}.sock"


def frontend_request_endpoint(plans: list[ReplicaPlan]) -> str:
    """What the frontend is given: every replica's request endpoint, separated by commas."""
    return ",".join(plan.endpoints.request for plan in plans)


def _threads_per_rank(args, count: int) -> int | None:
    """Each rank's threads: ``PAGEDSERVE_NUM_THREADS`` when set (passed on as the flag, which
    ``group_layout`` would otherwise set from the cores), else serve's choice shared among every
    rank of every replica, rounded down (the ranks of a group must have equal shares); None when
    ``--num-threads`` was given."""
    from shared.cpu_threads import asked_threads, choose_threads

    if args.num_threads:
        return None
    return asked_threads() or max(1, choose_threads(None).num_threads // (count * args.tensor_parallel_size))
