"""Collectives across hosts: ``TorchDistCommunicator`` over ``torch.distributed``.

gloo for CPU tensors, NCCL for GPU tensors, initialised from a ``HOST:PORT`` rendezvous address
(rank 0 serves a ``TCPStore`` there; the ``--dist-init-addr`` flag). Same contract as the other
communicators: sums in float32 for 16-bit inputs, gathers bit-exact (16-bit tensors travel as
int16 bits). A failed collective raises ``GroupError``; torch's message names the peer's address
when it knows it.
"""

from __future__ import annotations

import datetime

import torch

from .base import GroupError, check_tensor


def parse_init_addr(addr: str) -> tuple[str, int]:
    """``"10.0.0.1:29500"`` or ``"[::1]:29500"`` -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
    return host, int(port)


class TorchDistCommunicator:
    """Rank ``rank`` of ``world_size`` in torch.distributed's default process group."""

    kind = "torch"

    def __init__(self, rank: int, world_size: int, init_addr: str, device: torch.device | str = "cpu",
                 backend: str | None = None, timeout_s: float = 60.0) -> None:
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        host, port = parse_init_addr(init_addr)
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self._dist = dist
        self._closed = False
        try:
            dist.init_process_group(self.backend, init_method=f"tcp://{host}:{port}", rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as exc:  # DistStoreError / DistNetworkError are RuntimeErrors
            raise GroupError(f"rank {rank}: torch.distributed ({self.backend}) could not join "
                             f"{host}:{port} as one of {world_size} ranks: {exc}") from exc

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check(tensor)
        wide = tensor if tensor.dtype == torch.float32 and tensor.is_contiguous() else tensor.float()
        self._call("all_reduce", wide)
        if wide is not tensor:
            tensor.copy_(wide)
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check(tensor)
        wide = tensor.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        self._call("all_reduce", wide)
        return wide.to(tensor.dtype)

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        self._check(tensor)
        if not 0 <= dst < self.world_size:
            raise ValueError(f"gather to rank {dst} in a group of {self.world_size}")
        bits = tensor.contiguous()
        if bits.element_size() == 2:
            bits = bits.view(torch.int16)
        outs = [torch.empty_like(bits) for _ in range(self.world_size)] if self.rank == dst else None
        self._call("gather", bits, gather_list=outs, dst=dst)
        return None if outs is None else [o.view(tensor.dtype) for o in outs]

    def barrier(self) -> None:
        if self._closed:
            raise GroupError(f"rank {self.rank}'s communicator is closed")
        self._call("barrier")

    def abort(self, reason: str) -> None:
        """Leave the group at once: the peers' pending collectives fail (gloo sees the closed
        connections; NCCL after its timeout), naming this rank's address rather than its rank."""
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._dist.is_initialized():
                self._dist.destroy_process_group()

    def _check(self, tensor: torch.Tensor) -> None:
        if self._closed:
            raise GroupError(f"rank {self.rank}'s communicator is closed")
        check_tensor(tensor)
        if tensor.device.type != self.device.type:
            raise ValueError(f"rank {self.rank}'s {self.backend} group takes {self.device.type} tensors, "
                             f"got one on {tensor.device}")

    def _call(self, name: str, *args, **kwargs) -> None:
        try:
            getattr(self._dist, name)(*args, **kwargs)
        except RuntimeError as exc:
            raise GroupError(f"rank {self.rank}: torch.distributed {name} ({self.backend}) failed: {exc}") from exc
