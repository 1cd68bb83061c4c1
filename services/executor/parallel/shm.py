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

Waiting spins briefly, then yields the CPU (``os.sched_yield``), then sleeps in short naps, so
that ranks sharing few cores do not starve each other. While waiting past the spin it checks the
lagging peers: a peer that closed, aborted, died (pid gone, or a zombie) or did not arrive within
``WaitPolicy.timeout_s`` raises ``GroupError`` naming it; this rank then marks itself aborted
(with the culprit's rank, so the others report the same rank) and unlinks the group's names.

The data slots are host memory here; ``cuda_ipc.CudaIpcCommunicator`` keeps the flags and puts
the slots in GPU memory.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import msgpack
import torch

from .base import GroupError, check_tensor
from .segment import (
    DATA_OFFSET, STATUS_ABORTED, STATUS_CLOSED, W_CAUSE, W_CONNECTED, W_EPOCH, W_META,
    W_STATUS, Segment, cleanup_group, process_alive, process_identity, segment_name,
)

HANDLE_VERSION = 1
DEFAULT_SLOT_BYTES = 4 * 2**20
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_DTYPE_NAMES = {code: str(dtype) for dtype, code in _DTYPE_CODES.items()}


@dataclass(frozen=True)
class WaitPolicy:
    """How a rank waits for its peers: spin, then yield, then nap; give up after ``timeout_s``."""

    spin_s: float = 1e-4  # check the flags in a tight loop this long first
    yield_s: float = 0.002  # then os.sched_yield() between checks until this long
    sleep_s: float = 5e-5  # then time.sleep(sleep_s) between checks
    check_interval_s: float = 0.02  # how often lagging peers are checked for death
    timeout_s: float = 60.0  # a peer this late is declared hung

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or min(self.spin_s, self.yield_s, self.sleep_s) < 0:
            raise ValueError(f"bad wait policy {self}")


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

    def __init__(self, group_id: str, rank: int, world_size: int, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 policy: WaitPolicy = WaitPolicy()) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        if slot_bytes <= 0 or slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes}")
        self.group_id, self.rank, self.world_size = group_id, rank, world_size
        self.slot_bytes, self.policy = slot_bytes, policy
        self._epoch = 0  # the last epoch this rank published
        self._all_reached = 0  # every peer is known to have published this epoch
        self._error: GroupError | None = None
        self._closed = False
        self._peers: list[tuple[int, memoryview, dict]] = []  # (rank, header words, handle) per peer
        self._segments: list[Segment] = []
        self._bases: list[torch.Tensor] = []  # per rank: uint8 [2 * slot_bytes], both slots
        self._views: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._own = Segment.create(segment_name(group_id, rank), self._segment_bytes())
        self._handle = {"kind": self.kind, "version": HANDLE_VERSION, "group_id": group_id,
                        "rank": rank, "world_size": world_size, "host": socket.gethostname(),
                        "segment": self._own.name, "segment_bytes": self._own.size_bytes,
                        "slot_bytes": slot_bytes}
        pid, start, namespace = process_identity()
        self._handle.update(pid=pid, pid_start=start, pid_ns=namespace)

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
        """Map every rank's slots from their handles (indexed by rank), then unlink our name."""
        infos = [decode_handle(raw) for raw in handles]
        if len(infos) != self.world_size:
            raise GroupError(f"{len(infos)} handles for a group of {self.world_size}")
        for r, info in enumerate(infos):
            expect = {k: self._handle[k] for k in ("kind", "group_id", "world_size", "host", "slot_bytes")}
            got = {k: info.get(k) for k in expect}
            if got != expect or info.get("rank") != r:
                self._fail(f"rank {r}'s handle {got} (rank {info.get('rank')}) does not match "
                           f"{expect}: different group, host or slot size", r)
            if r == self.rank:
                segment = self._own
            else:
                try:
                    segment = Segment.attach(info["segment"], info["segment_bytes"])
                except (OSError, ValueError) as exc:
                    self._fail(f"cannot map rank {r}'s segment {info['segment']}: {exc}", r)
                self._segments.append(segment)
                self._peers.append((r, segment.words, info))
            self._bases.append(self._slot_base(r, segment, info))
        self._own.words[W_CONNECTED] = 1
        self._wait_peers(W_CONNECTED, 1, "connect")
        self._own.unlink()  # every rank has mapped us: the name is no longer needed

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

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._error is None:
            self._own.words[W_STATUS] = STATUS_CLOSED
        self._own.unlink()
        self._views.clear()
        self._bases.clear()
        self._peers.clear()
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
        self._wait_epoch(epoch - 1)
        slot = epoch & 1
        if chunk is not None:
            self._slot_views(dtype)[slot][self.rank][:size].copy_(chunk)
        self._before_publish()
        words = self._own.words
        words[W_META + slot] = (size << 8) | _DTYPE_CODES.get(dtype, 0)
        words[W_EPOCH] = epoch
        self._epoch = epoch
        return slot

    def _read(self, slot: int, size: int, dtype: torch.dtype | None) -> list[torch.Tensor]:
        """Step 3: wait for every peer's epoch, check what they sent, view every rank's chunk."""
        self._wait_epoch(self._epoch)
        expect = (size << 8) | _DTYPE_CODES.get(dtype, 0)
        for r, words, _ in self._peers:
            meta = words[W_META + slot]
            if meta != expect:
                self._fail(f"collective {self._epoch}: rank {r} sent {meta >> 8} elements of "
                           f"{_DTYPE_NAMES.get(meta & 0xFF)}, rank {self.rank} expected {size} of {dtype}", r)
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

    def _wait_epoch(self, epoch: int) -> None:
        if self._all_reached >= epoch:
            return
        clock = time.perf_counter
        until = clock() + self.policy.spin_s
        while True:
            for _r, words, _h in self._peers:
                if words[W_EPOCH] < epoch:
                    break
            else:
                self._all_reached = epoch
                return
            if clock() > until:
                break
        self._wait_peers(W_EPOCH, epoch, f"collective {epoch}")
        self._all_reached = epoch

    def _wait_peers(self, word: int, value: int, what: str) -> None:
        """Until every peer's header ``word`` >= ``value``: yield, nap, check the laggards."""
        policy = self.policy
        start = now = time.monotonic()
        next_check = now
        while True:
            lagging = [(r, words, h) for r, words, h in self._peers if words[word] < value]
            if not lagging:
                return
            if now >= next_check:
                self._check_lagging(lagging, what, now - start)
                next_check = now + policy.check_interval_s
            if now - start < policy.yield_s:
                os.sched_yield()
            else:
                time.sleep(policy.sleep_s)
            now = time.monotonic()

    def _check_lagging(self, lagging, what: str, waited_s: float) -> None:
        for r, words, h in lagging:
            status = words[W_STATUS]
            if status == STATUS_ABORTED:
                cause = words[W_CAUSE]
                self._fail(f"rank {cause} failed (reported by rank {r}); rank {self.rank} was at {what}", cause)
            if status == STATUS_CLOSED:
                self._fail(f"rank {r} closed while rank {self.rank} waited for it at {what}", r)
            if not process_alive(h["pid"], h["pid_start"], h["pid_ns"]):
                self._fail(f"rank {r} (pid {h['pid']}) died; rank {self.rank} was at {what}", r)
        if waited_s > self.policy.timeout_s:
            ranks = [r for r, _, _ in lagging]
            self._fail(f"ranks {ranks} did not reach {what} within {self.policy.timeout_s:g} s "
                       f"(rank {self.rank} waited {waited_s:.1f} s)", ranks[0])

    def _fail(self, message: str, rank: int | None):
        """Abort: tell the peers who is at fault, unlink the group's names, raise."""
        self._error = GroupError(message, rank)
        words = self._own.words
        words[W_CAUSE] = -1 if rank is None else rank
        words[W_STATUS] = STATUS_ABORTED
        cleanup_group(self.group_id)
        raise self._error

    def _check_usable(self) -> None:
        if self._error is not None:
            raise GroupError(f"the group already failed: {self._error}", self._error.rank)
        if self._closed:
            raise GroupError(f"rank {self.rank}'s communicator is closed")

