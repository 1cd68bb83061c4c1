"""Same-host collectives through buffers every rank maps: ``ShmCommunicator`` (CPU tensors).

Each rank owns one segment (``segment``): a header of flags and two data slots. The ranks swap
*handles* (msgpack bytes naming the segments) at start-up, map each other's segments, and from
then on exchange data without any socket.

One collective step (``epoch`` e, counting from 1, the same on every rank):
  1. wait until every peer's epoch is >= e - 1 (normally already true: see below);
  2. copy this rank's chunk into its slot ``e % 2``, write the slot's metadata (element count and
     dtype, checked by the readers), then publish epoch e;
  3. readers wait until every peer's epoch is >= e, then read all ranks' slots ``e % 2``.
Why two slots make step 1 enough: a rank overwrites slot ``e % 2`` only at epoch e + 2, after it
saw every peer reach e + 1, and a peer publishes e + 1 only after it finished reading epoch e.
All-reduce sums the ranks' chunks in rank order, in float32 for 16-bit inputs, so every rank gets
the same bits. Tensors larger than a slot go through it in chunks, one epoch each.

Waiting, and what happens when a peer dies or hangs, is ``flags.PeerFlags``'s job: an error
names the rank at fault on every rank, and the group's names are unlinked.

The data slots are host memory here; ``cuda_ipc.CudaIpcCommunicator`` keeps the flags and puts
the slots in GPU memory.
"""

from __future__ import annotations

import platform
import socket

import msgpack
import torch

from .base import GroupError, check_tensor
from .peer_flags import PeerFlags, WaitPolicy
from .segment import DATA_OFFSET, Segment, cleanup_group, process_identity, segment_name

HANDLE_VERSION = 1
DEFAULT_SLOT_BYTES = 4 * 2**20
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_DTYPE_NAMES = {code: str(dtype) for dtype, code in _DTYPE_CODES.items()}


def encode_handle(fields: dict) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def decode_handle(raw: bytes) -> dict:
    try:
        fields = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise GroupError(f"a rank's handle is not msgpack: {exc}") from exc
    if not isinstance(fields, dict) or fields.get("version") != HANDLE_VERSION:
        raise GroupError(f"a rank's handle is not a version-{HANDLE_VERSION} handle: {fields!r:.200}")
    return fields


class ShmCommunicator:
    """Rank ``rank`` of ``world_size`` ranks sharing ``group_id``; see the module docstring."""

    kind = "shm"
    device = torch.device("cpu")  # where the tensors handed to the collectives must live
    # The slots are written and read by plain CPU stores and loads, published by a flag store:
    # correct under x86-64's total store order, not on weaker memory models without fences.
    needs_store_order = True

    def __init__(self, group_id: str, rank: int, world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 policy: WaitPolicy = WaitPolicy()) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        machine = platform.machine().lower()
        if self.needs_store_order and machine not in ("x86_64", "amd64"):
            raise ValueError(f"the shared-memory all-reduce needs x86-64 store ordering; this host is "
                             f"{machine}: use --all-reduce torch")
        if slot_bytes <= 0 or slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes}")
        self.group_id, self.rank, self.world_size = group_id, rank, world_size
        self.slot_bytes = slot_bytes
        self._epoch = 0  # the last epoch this rank published
        self._closed = False
        self._segments: list[Segment] = []
        self._bases: list[torch.Tensor] = []  # per rank: uint8 [2 * slot_bytes], both slots
        self._views: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._own = Segment.create(segment_name(group_id, rank), self._segment_bytes())
        self._flags = PeerFlags(self._own.words, group_id, rank, policy)
        self._handle = {"kind": self.kind, "version": HANDLE_VERSION, "group_id": group_id,
                        "rank": rank, "world_size": world_size, "host": socket.gethostname(),
                        "segment": self._own.name, "segment_bytes": self._own.size_bytes,
                        "slot_bytes": slot_bytes}
        pid, start, namespace = process_identity()
        self._handle.update(pid=pid, pid_start=start, pid_ns=namespace)

    def set_wait_policy(self, policy: WaitPolicy) -> None:
        """Change how this rank waits (benchmarks compare policies within one group)."""
        self._flags.policy = policy

    # ------------------------------------------------------------------ hooks for other slot memory

    def _segment_bytes(self) -> int:
        return DATA_OFFSET + 2 * self.slot_bytes

    def _slot_base(self, rank: int, segment: Segment, handle: dict) -> torch.Tensor:
        """uint8 [2 * slot_bytes]: rank ``rank``'s two slots, as this process sees them."""
        return torch.frombuffer(segment.mm, dtype=torch.uint8, count=2 * self.slot_bytes, offset=DATA_OFFSET)

    def _before_publish(self) -> None:
        """Make this rank's slot writes (and its reads of peers' slots) complete before publishing."""

    # ------------------------------------------------------------------ handshake

    def local_handle(self) -> bytes:
        """This rank's handle (msgpack bytes) for the start-up exchange."""
        return encode_handle(self._handle)

    def connect(self, handles: list[bytes]) -> None:
        """Map every rank's slots from their handles (indexed by rank), then unlink the names."""
        infos = [decode_handle(raw) for raw in handles]
        if len(infos) != self.world_size:
            raise GroupError(f"{len(infos)} handles for a group of {self.world_size}")
        for r, info in enumerate(infos):
            expect = {k: self._handle[k] for k in ("kind", "group_id", "world_size", "slot_bytes")}
            got = {k: info.get(k) for k in expect}
            if got != expect or info.get("rank") != r:
                self._flags.fail(f"rank {r}'s handle {got} (rank {info.get('rank')}) does not match "
                                 f"{expect}: a different group, kind or slot size", r)
            if r == self.rank:
                segment = self._own
            else:
                segment = self._attach(r, info)
                self._segments.append(segment)
                self._flags.peers.append((r, segment.words, info))
            self._bases.append(self._slot_base(r, segment, info))
        self._flags.connect()
        # Every rank has mapped every segment: no name is needed any more. Each rank removes them
        # all, so a rank killed right after connecting cannot leave its own behind.
        cleanup_group(self.group_id)

    def _attach(self, rank: int, info: dict) -> Segment:
        try:
            return Segment.attach(info["segment"], info["segment_bytes"])
        except (OSError, ValueError) as exc:
            where = "" if info.get("host") == self._handle["host"] else (
                f"; rank {rank} runs on host {info.get('host')!r} and rank {self.rank} on "
                f"{self._handle['host']!r}: shared memory needs one host (or one IPC namespace), "
                f"use --all-reduce torch across hosts")
            self._flags.fail(f"cannot map rank {rank}'s segment {info['segment']}: {exc}{where}", rank)

    # ------------------------------------------------------------------ collectives

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = self._flat(tensor)  # a view of tensor, or a private copy when it is not contiguous
        self._reduce(flat, flat)  # safe in place: each chunk is copied to the slot before it is summed
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = self._flat(tensor)
        out = torch.empty_like(flat)
        self._reduce(flat, out)
        return out.view(tensor.shape)

    def gather(self, tensor: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        if not 0 <= dst < self.world_size:
            raise ValueError(f"gather to rank {dst} in a group of {self.world_size}")
        flat = self._flat(tensor)
        outs = [torch.empty_like(flat) for _ in range(self.world_size)] if self.rank == dst else None
        for start, size in self._chunks(flat):
            chunk = flat[start:start + size]
            slot = self._publish(chunk if outs is None else None, size, flat.dtype)
            if outs is not None:
                for r, view in enumerate(self._read(slot, size, flat.dtype)):
                    outs[r][start:start + size].copy_(chunk if r == self.rank else view)
        return None if outs is None else [o.view(tensor.shape) for o in outs]

    def barrier(self) -> None:
        self._check_usable()
        slot = self._publish(None, 0, None)
        self._read(slot, 0, None)

    def abort(self, reason: str) -> None:
        """This rank cannot go on (e.g. its step failed): the peers raise ``GroupError`` naming it."""
        if not self._closed:
            self._flags.abort(reason, self.rank)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._flags.close()
        self._own.unlink()
        self._views.clear()
        self._bases.clear()
        self._flags.peers.clear()
        for segment in [*self._segments, self._own]:
            segment.close()
        self._segments.clear()

    # ------------------------------------------------------------------ the epoch protocol

    def _flat(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check_usable()
        check_tensor(tensor)
        if tensor.device != self.device:
            raise ValueError(f"rank {self.rank}'s {self.kind} group takes tensors on {self.device}, "
                             f"got one on {tensor.device}")
        return tensor.contiguous().view(-1)

    def _chunks(self, flat: torch.Tensor):
        capacity = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), capacity):
            yield start, min(capacity, flat.numel() - start)

    def _slot_views(self, dtype: torch.dtype) -> list[list[torch.Tensor]]:
        """[slot][rank] -> 1-D views of ``dtype`` over each rank's slot (cached)."""
        views = self._views.get(dtype)
        if views is None:
            sb = self.slot_bytes
            views = [[base[s * sb:(s + 1) * sb].view(dtype) for base in self._bases] for s in (0, 1)]
            self._views[dtype] = views
        return views

    def _publish(self, chunk: torch.Tensor | None, size: int, dtype: torch.dtype | None) -> int:
        """Steps 1 and 2: write ``chunk`` (or nothing) into the next slot and publish its epoch."""
        epoch = self._epoch + 1
        self._flags.wait_epoch(epoch - 1)
        slot = epoch & 1
        if chunk is not None:
            self._slot_views(dtype)[slot][self.rank][:size].copy_(chunk)
        self._before_publish()
        self._flags.publish(epoch, slot, (size << 8) | _DTYPE_CODES.get(dtype, 0))
        self._epoch = epoch
        return slot

    def _read(self, slot: int, size: int, dtype: torch.dtype | None) -> list[torch.Tensor]:
        """Step 3: wait for every peer's epoch, check what they sent, view every rank's chunk."""
        self._flags.wait_epoch(self._epoch)
        self._flags.check_meta(slot, (size << 8) | _DTYPE_CODES.get(dtype, 0), lambda r, meta: (
            f"collective {self._epoch}: rank {r} sent {meta >> 8} elements of {_DTYPE_NAMES.get(meta & 0xFF)}, "
            f"rank {self.rank} expected {size} of {dtype}"))
        if dtype is None:
            return []
        return [view[:size] for view in self._slot_views(dtype)[slot]]

    def _reduce(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        for start, size in self._chunks(flat):
            slot = self._publish(flat[start:start + size], size, flat.dtype)
            views = self._read(slot, size, flat.dtype)
            target = out[start:start + size]
            if flat.dtype == torch.float32 and len(views) > 1:
                torch.add(views[0], views[1], out=target)
                for view in views[2:]:
                    target.add_(view)
            else:
                acc = views[0].float()
                for view in views[1:]:
                    acc.add_(view)
                target.copy_(acc)

    def _check_usable(self) -> None:
        error = self._flags.error
        if error is not None:
            raise GroupError(f"the group already failed: {error}", error.rank)
        if self._closed:
            raise GroupError(f"rank {self.rank}'s communicator is closed")

