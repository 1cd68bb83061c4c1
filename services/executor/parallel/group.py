"""Open this rank's communicator from its configuration: the one call an executor rank makes.

``all_reduce="auto"`` picks shared memory when every rank is on this host (``num_nodes == 1``):
``CudaIpcCommunicator`` for a CUDA device, ``ShmCommunicator`` otherwise; across hosts it picks
``torch.distributed``. ``"shm"`` or ``"torch"`` force one (the ``--all-reduce`` flag). The
same-host kinds swap their handles through a ``FileStore`` at ``store_path`` (a file in the
launcher's private directory) and name their segments after ``group_id``; the torch kind meets
at ``dist_init_addr``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine_flags import ParallelFlags, RankFlags

from .base import Communicator, SingleRank

ALL_REDUCE_KINDS = ("auto", "shm", "torch")
_RANK, _PARALLEL = RankFlags(), ParallelFlags()  # the flags' defaults, declared there once


@dataclass(frozen=True)
class GroupConfig:
    rank: int = _RANK.rank
    world_size: int = _RANK.world_size
    all_reduce: str = _PARALLEL.all_reduce
    num_nodes: int = _PARALLEL.num_nodes
    group_id: str | None = None  # same host: names the shared-memory segments
    store_path: str | None = None  # same host: the FileStore of the handle exchange
    dist_init_addr: str | None = None  # torch: HOST:PORT of rank 0's store
    timeout_s: float = _PARALLEL.group_timeout_s  # start-up and per-collective limit before a peer is declared hung
    slot_bytes: int | None = None  # same host: the size of each data slot (None: the default)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"--rank {self.rank} must be in [0, --tensor-parallel-size {self.world_size})")
        if self.all_reduce not in ALL_REDUCE_KINDS:
            raise ValueError(f"--all-reduce must be one of {', '.join(ALL_REDUCE_KINDS)}, got {self.all_reduce!r}")
        if self.num_nodes < 1 or self.world_size % self.num_nodes:
            raise ValueError(f"--nnodes {self.num_nodes} must divide --tensor-parallel-size {self.world_size}")
        if self.world_size == 1:
            return
        if self.kind == "torch" and not self.dist_init_addr:
            raise ValueError("--all-reduce torch (or --nnodes > 1) needs --dist-init-addr HOST:PORT")
        if self.kind == "shm" and not (self.group_id and self.store_path):
            raise ValueError("the shared-memory all-reduce needs a group id and a handle store path "
                             "(--group-id, --group-store; serve sets them)")
        if self.kind == "shm" and self.num_nodes > 1:
            raise ValueError(f"--all-reduce shm works on one host; --nnodes is {self.num_nodes}")

    @property
    def kind(self) -> str:
        """``"shm"`` (same host, CPU or CUDA IPC) or ``"torch"``."""
        if self.all_reduce != "auto":
            return self.all_reduce
        return "shm" if self.num_nodes == 1 else "torch"


def open_group(config: GroupConfig, device: torch.device | str = "cpu") -> Communicator:
    """A connected communicator for ``config.rank`` (blocks until every rank has joined)."""
    device = torch.device(device)
    if config.world_size == 1:
        return SingleRank()
    if config.kind == "torch":
        from .torch_dist import TorchDistCommunicator

        return TorchDistCommunicator(config.rank, config.world_size, config.dist_init_addr, device=device,
                                     timeout_s=config.timeout_s)
    from .peer_flags import WaitPolicy
    from .rendezvous import exchange_handles, file_store

    options = {"policy": WaitPolicy(timeout_s=config.timeout_s)}
    if config.slot_bytes is not None:
        options["slot_bytes"] = config.slot_bytes
    if device.type == "cuda":
        from .cuda_ipc import CudaIpcCommunicator

        comm = CudaIpcCommunicator(config.group_id, config.rank, config.world_size, device, **options)
    else:
        from .shm import ShmCommunicator

        comm = ShmCommunicator(config.group_id, config.rank, config.world_size, **options)
    try:
        store = file_store(config.store_path, config.world_size)
        comm.connect(exchange_handles(store, config.rank, config.world_size, comm.local_handle(), config.timeout_s))
    except BaseException:
        comm.close()
        raise
    return comm
