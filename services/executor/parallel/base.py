"""The collective-communication interface of a tensor-parallel group, and its one-rank form.

Contract shared by every implementation: one thread per rank uses the communicator, and all
ranks call the same collectives in the same order with tensors of the same shape and dtype (the model's control flow is identical on every rank
because every rank runs the same ``Step``). Sums are taken in float32 for 16-bit inputs and cast
back; every rank receives the same bits. A failure of the group (a peer that died, closed, hung
past the timeout or sent a mismatched tensor) raises ``GroupError`` naming the rank; after one the
communicator is unusable and every later call raises again.
"""

from __future__ import annotations

from typing import Protocol

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GroupError(RuntimeError):
    """The group cannot continue; ``rank`` is the rank at fault (``None`` when unknown)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class Communicator(Protocol):
    """Collectives over ``world_size`` ranks; this object is rank ``rank``."""

    kind: str  # "single", "shm", "cuda_ipc" or "torch"
    rank: int
    world_size: int

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace ``tensor`` with the element-wise sum over ranks (in place); returns it."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over ranks as a new tensor; ``tensor`` is left unchanged."""

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """On ``dst``: every rank's ``tensor``, indexed by rank. Elsewhere: ``None``."""

    def barrier(self) -> None:
        """Return once every rank has called ``barrier``."""

    def abort(self, reason: str) -> None:
        """This rank cannot go on (its step failed half-way): make every peer's next or current
        collective raise ``GroupError`` naming this rank, instead of waiting for it."""

    def close(self) -> None:
        """Release buffers and tell the peers this rank has left; idempotent."""


def check_tensor(tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"collectives take {names} tensors, got {tensor.dtype}")


def failed_on_any_rank(comm, failed: list[bool], device=None) -> list[bool]:
    """Each flag OR-ed over the group's ranks, so that all agree on a per-rank action that may fail
    on some ranks only (a block file read or written): one all-reduce, none for one rank or no flags."""
    if comm is None or comm.world_size == 1 or not failed:
        return list(failed)
    flags = torch.tensor([1.0 if f else 0.0 for f in failed], dtype=torch.float32, device=device)
    return [bool(x > 0) for x in comm.all_reduce(flags).cpu().tolist()]


class SingleRank:
    """A group of one: every collective is the identity. Used when tensor parallelism is off."""

    kind = "single"
    rank = 0
    world_size = 1

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        check_tensor(tensor)
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        check_tensor(tensor)
        return tensor.clone()

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        check_tensor(tensor)
        if dst != 0:
            raise ValueError(f"gather to rank {dst} in a group of 1")
        return [tensor.clone()]

    def barrier(self) -> None:
        pass

    def abort(self, reason: str) -> None:
        pass

    def close(self) -> None:
        pass
