"""How ``pagedserve serve`` lays out its executor group: which ranks run on this host, the flags
each rank gets, how the ranks meet, and where the scheduler's step and result sockets are when
the ranks span hosts. Plain data and argv lists; ``launcher`` starts the processes.

One host (``--nnodes 1``): ranks ``0..N-1`` run here and reach the scheduler through the
launcher's private ``ipc://`` directory. The shared-memory all-reduce names its segments after a
fresh group id and swaps its handles through a file in that directory; the torch all-reduce meets
at ``--dist-init-addr``, or at a free local port when none is given.

Several hosts (``--nnodes M``): host ``k`` (``--node-rank k``) runs ranks ``[k * N/M, (k+1) * N/M)``
and host 0 also the scheduler and the frontend. The ranks meet at ``--dist-init-addr HOST:PORT``
(rank 0's torch.distributed store, so HOST is host 0) and reach the scheduler at
``tcp://HOST:PORT+1`` (steps) and ``tcp://HOST:PORT+2`` (results), which host 0's scheduler binds.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
from dataclasses import dataclass

STEP_PORT_OFFSET, RESULT_PORT_OFFSET = 1, 2


@dataclass(frozen=True)
class GroupLayout:
    world_size: int = 1
    num_nodes: int = 1
    node_rank: int = 0
    all_reduce: str = "auto"
    dist_init_addr: str | None = None
    group_id: str = ""
    store_path: str = ""
    timeout_s: float | None = None  # None: the executors' default

    @property
    def local_ranks(self) -> range:
        per_node = self.world_size // self.num_nodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @property
    def runs_scheduler(self) -> bool:
        """Host 0 runs the scheduler and the frontend; the other hosts only their ranks."""
        return self.node_rank == 0

    def group_config(self, rank: int):
        """The ``GroupConfig`` rank ``rank`` will open (validates the flags; imports torch)."""
        from services.executor.parallel.group import GroupConfig

        timeout = {} if self.timeout_s is None else {"timeout_s": self.timeout_s}
        return GroupConfig(rank=rank, world_size=self.world_size, all_reduce=self.all_reduce,
                           num_nodes=self.num_nodes, group_id=self.group_id, store_path=self.store_path,
                           dist_init_addr=self.dist_init_addr, **timeout)

    def scheduler_argv(self) -> list[str]:
        if self.world_size == 1:
            return []
        return ["--world-size", str(self.world_size), *self._tcp_endpoints(bind=True)]

    def executor_argv(self, rank: int, num_threads: int | None) -> list[str]:
        """Rank ``rank``'s group flags; ``num_threads`` None: this host's cores shared by its ranks."""
        if self.world_size == 1:
            return []
        argv = ["--rank", str(rank), "--world-size", str(self.world_size), "--all-reduce", self.all_reduce,
                "--nnodes", str(self.num_nodes), "--group-id", self.group_id, "--group-store", self.store_path]
        if self.dist_init_addr:
            argv += ["--dist-init-addr", self.dist_init_addr]
        if self.timeout_s is not None:
            argv += ["--group-timeout", str(self.timeout_s)]
        if num_threads is None:
            argv += ["--num-threads", str(max(1, (os.cpu_count() or 1) // len(self.local_ranks)))]
        return argv + self._tcp_endpoints(bind=False)

    def _tcp_endpoints(self, bind: bool) -> list[str]:
        """Across hosts, the step and result endpoint flags: the scheduler binds host 0's address,
        the ranks connect to it. On one host: none (the private directory's ipc:// endpoints)."""
        if self.num_nodes == 1:
            return []
        from services.executor.parallel.torch_dist import parse_init_addr

        host, port = parse_init_addr(self.dist_init_addr)
        if bind:
            try:
                host = socket.gethostbyname(host)
            except OSError as exc:
                raise ValueError(f"--dist-init-addr {self.dist_init_addr}: cannot resolve {host}: {exc}") from exc
        return ["--step-endpoint", f"tcp://{host}:{port + STEP_PORT_OFFSET}",
                "--result-endpoint", f"tcp://{host}:{port + RESULT_PORT_OFFSET}"]


def layout_from_args(args, sock_dir: str, store_name: str = "group-store") -> GroupLayout:
    """Serve's group flags, validated (``ValueError`` naming the flag) before anything starts;
    ``store_name``: the handle store's file in ``sock_dir`` (one per data-parallel replica)."""
    world_size, num_nodes = args.tensor_parallel_size, args.num_nodes or 1
    if world_size < 1:
        raise ValueError(f"-tp/--tensor-parallel-size must be at least 1, got {world_size}")
    if not 0 <= args.node_rank < num_nodes:
        raise ValueError(f"--node-rank {args.node_rank} must be in [0, --nnodes {num_nodes})")
    layout = GroupLayout(world_size, num_nodes, args.node_rank, args.all_reduce or "auto", args.dist_init_addr,
                         secrets.token_hex(6), os.path.join(sock_dir, store_name), args.group_timeout_s)
    if world_size == 1 and num_nodes == 1:
        return layout
    if layout.all_reduce == "torch" and num_nodes == 1 and not layout.dist_init_addr:
        layout = dataclasses.replace(layout, dist_init_addr=f"127.0.0.1:{_free_port()}")
    layout.group_config(layout.local_ranks[0])
    layout.scheduler_argv()  # resolves the rendezvous host on host 0
    return layout


def check_model_split(model: str | None, world_size: int) -> None:
    """Raise ``ValueError`` (naming -tp) if the model's heads cannot be split ``world_size`` ways."""
    from services.executor.architectures import model_config
    from services.executor.parallel.sharding import ShardPlan
    from services.executor.weights import load_hf_config
    from shared.model_source import resolve_model

    ShardPlan.for_model(model_config(load_hf_config(resolve_model(model))), 0, world_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
