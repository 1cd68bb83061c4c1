"""Same-host collectives between GPU ranks: ``CudaIpcCommunicator``.

The epoch protocol of ``shm.ShmCommunicator`` unchanged, with the two data slots in GPU memory:
each rank allocates one device buffer and puts its CUDA IPC memory handle (torch's
``UntypedStorage._share_cuda_()`` tuple: device, handle bytes, sizes, offsets, the producer's
reference-counter and event handles — ints, bytes and a bool, so msgpack carries it) in its
handle; every peer opens it once at ``connect`` (``UntypedStorage._new_shared_cuda``, what
``torch.multiprocessing`` does) and keeps it for the group's life. The flags stay in a small
POSIX shared-memory segment (the header only).

Ordering: a rank synchronizes its current stream before publishing an epoch, so its slot writes,
and its reads of the peers' slots from the previous epoch, are complete when the peers see the
flag. Peers' slots on another device are copied to this rank's device before summing.
"""

from __future__ import annotations

import torch

from .segment import DATA_OFFSET, Segment
from .peer_flags import WaitPolicy
from .shm import DEFAULT_SLOT_BYTES, ShmCommunicator


class CudaIpcCommunicator(ShmCommunicator):
    kind = "cuda_ipc"
    needs_store_order = False  # data moves by device copies and stream synchronization, not CPU stores

    def __init__(self, group_id: str, rank: int, world_size: int, device: torch.device | str,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, policy: WaitPolicy = WaitPolicy()) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaIpcCommunicator needs a CUDA device, got {device}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self._buffer = torch.zeros(2 * slot_bytes, dtype=torch.uint8, device=self.device)
        super().__init__(group_id, rank, world_size, slot_bytes, policy)
        device_idx, *rest = self._buffer.untyped_storage()._share_cuda_()
        self._handle["cuda"] = [device_idx, *rest]

    def _segment_bytes(self) -> int:
        return DATA_OFFSET  # flags only: the data lives on the GPU

    def _slot_base(self, rank: int, segment: Segment, handle: dict) -> torch.Tensor:
        if rank == self.rank:
            return self._buffer
        fields = handle.get("cuda")
        if not isinstance(fields, list) or len(fields) != 8:
            self._flags.fail(f"rank {rank}'s handle carries no CUDA IPC handle (is it a CPU rank?)", rank)
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
        peer_device = torch.device("cuda", fields[0])
        return torch.empty(0, dtype=torch.uint8, device=peer_device).set_(storage, 0, (2 * self.slot_bytes,))

    def _before_publish(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def _read(self, slot: int, size: int, dtype):
        views = super()._read(slot, size, dtype)
        return [v if v.device == self.device else v.to(self.device) for v in views]

    def close(self) -> None:
        super().close()
        self._buffer = None
