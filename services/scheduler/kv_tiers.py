"""The KV offload tiers' books (``--kv-offload-memory``, ``--kv-offload-dir``): which prefix-cache
blocks, by hash, a host pool and a directory hold, and the ordered moves the executors must make.
Plain Python, no I/O.

Contract:
- Host tier: ``num_host_blocks`` slots. A hashed device block that the prefix cache evicts is
  copied to a slot (``offload``: ``OFFLOAD (device block, slot)``); a hash already held there is
  only touched. Slots are taken free first, else from the least recently used hash, which goes to
  the disk tier first when there is one (``SPILL (slot, key)``, the executor snapshots the bytes
  before any later move overwrites the slot) and is dropped otherwise.
- Disk tier: at most ``num_disk_blocks`` hashes, each *pending* (a spill sent, its write not yet
  confirmed: never a hit) or *stored* (confirmed by the executors, ``on_stored``). Room is made by
  deleting the least recently used stored hash (``DELETE (key)``); with only pending ones the spill
  is skipped. ``adopt`` takes the hashes a restarted executor found in its directory, oldest first.
- Loads: ``load(hash)`` reserves a slot (*loading*: never evicted, never a hit) and sends
  ``LOAD (key, slot)``; ``on_loaded(hash, ok)`` makes it a host hit, or frees the slot and forgets
  the hash on disk (a corrupt, truncated, foreign or missing file is never served).
- ``reload(hash, device block)`` sends ``RELOAD (slot, device block)``: the block's bytes are the
  hash's before anything later in the same or a later step reads it (moves run in order).
- ``pin``/``unpin``: hashes whose host copies a waiting sequence is about to reuse; their slots
  are never taken (an offload that finds only pinned ones keeps nothing).
- Moves accumulate in order in ``ops`` (kind, a, b; a key is an index into ``keys``) until
  ``take_ops``; the scheduler puts them in the next ``Step``.
- ``reset_host`` forgets the host pool and everything in flight (the executors that held it were
  replaced); stored disk hashes stay (their files do).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from enum import IntEnum

import numpy as np


class TierOp(IntEnum):
    OFFLOAD = 1  # (device block, host slot)
    RELOAD = 2  # (host slot, device block)
    SPILL = 3  # (host slot, key): write the slot's bytes to the key's file
    LOAD = 4  # (key, host slot): read the key's file into the slot, report loaded or failed
    DELETE = 5  # (key, -1): remove the key's file


class TierIndex:
    def __init__(self, num_host_blocks: int, num_disk_blocks: int = 0) -> None:
        if num_host_blocks <= 0 or num_disk_blocks < 0:
            raise ValueError(f"tiers need host blocks (got {num_host_blocks}) and disk blocks >= 0 "
                             f"(got {num_disk_blocks})")
        self.num_host_blocks, self.num_disk_blocks = num_host_blocks, num_disk_blocks
        self.stored: OrderedDict[bytes, None] = OrderedDict()  # on disk, confirmed, oldest first
        self.pending: set[bytes] = set()  # spilled, write not yet confirmed
        self.pins: Counter[bytes] = Counter()  # host hashes a waiting sequence is about to reuse
        self.counts = dict.fromkeys(("offloaded", "reloaded", "spilled", "loaded", "load_failed", "deleted"), 0)
        self.reset_host()

    def reset_host(self) -> None:
        self.host: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        self.loading: dict[bytes, int] = {}  # hash -> slot being read from disk
        self.free_slots = list(range(self.num_host_blocks - 1, -1, -1))
        self.pending.clear()
        self.ops: list[tuple[int, int, int]] = []
        self.keys: list[bytes] = []

    # ------------------------------------------------------------------ queries

    def where(self, h: bytes) -> str | None:
        """"host", "disk" (stored), "loading" or None."""
        if h in self.host:
            return "host"
        if h in self.loading:
            return "loading"
        return "disk" if h in self.stored else None

    def num_loadable(self) -> int:
        """Slots a load may take now: free ones and those of hashes in the host tier."""
        return len(self.free_slots) + len(self.host)

    # ------------------------------------------------------------------ moves

    def offload(self, h: bytes, device_block: int) -> None:
        """The prefix cache evicts ``device_block`` holding ``h``: keep its bytes on the host."""
        if h in self.host:
            self.host.move_to_end(h)
            return
        if h in self.loading:
            return  # the same bytes are on their way from disk
        slot = self._slot()
        if slot is None:
            return
        self.host[h] = slot
        self.ops.append((TierOp.OFFLOAD, device_block, slot))
        self.counts["offloaded"] += 1

    def reload(self, h: bytes, device_block: int) -> None:
        slot = self.host[h]
        self.host.move_to_end(h)
        self.ops.append((TierOp.RELOAD, slot, device_block))
        self.counts["reloaded"] += 1

    def load(self, h: bytes) -> bool:
        """Read stored ``h`` into a host slot; False if no slot can be had."""
        if h not in self.stored or h in self.host or h in self.loading:
            return False
        self.stored.move_to_end(h)
        self.loading[h] = -1  # so that making room (a spill, a delete) keeps its file
        slot = self._slot()
        if slot is None:
            del self.loading[h]
            return False
        self.loading[h] = slot
        self.ops.append((TierOp.LOAD, self._key(h), slot))
        return True

    def on_loaded(self, h: bytes, ok: bool) -> None:
        slot = self.loading.pop(h, None)
        if slot is None:
            return  # a result from before reset_host
        if ok:
            self.host[h] = slot
            self.counts["loaded"] += 1
        else:
            self.free_slots.append(slot)
            self.stored.pop(h, None)
            self.counts["load_failed"] += 1

    def on_stored(self, h: bytes, ok: bool) -> None:
        if h not in self.pending:
            return
        self.pending.discard(h)
        if ok:
            self.stored[h] = None

    def adopt(self, hashes: list[bytes]) -> None:
        """Hashes found on disk at start, oldest first; beyond the bound the oldest are deleted."""
        for h in hashes:
            self.stored[h] = None
            self.stored.move_to_end(h)
        while len(self.stored) > self.num_disk_blocks and self._delete_oldest():
            pass

    def pin(self, hashes) -> None:
        """Keep ``hashes``' host copies (a sequence about to reuse them): their slots are not taken."""
        self.pins.update(hashes)

    def unpin(self, hashes) -> None:
        self.pins.subtract(hashes)
        self.pins += Counter()  # drops those at zero

    def take_ops(self) -> tuple[np.ndarray, list[bytes]]:
        ops, keys = np.array(self.ops, np.int64).reshape(-1, 3), self.keys
        self.ops, self.keys = [], []
        return ops, keys

    # ------------------------------------------------------------------ internals

    def _key(self, h: bytes) -> int:
        self.keys.append(h)
        return len(self.keys) - 1

    def _slot(self) -> int | None:
        """A free slot, else the least recently used host hash's (spilled to disk first)."""
        if self.free_slots:
            return self.free_slots.pop()
        victim = next((h for h in self.host if h not in self.pins), None)
        if victim is None:
            return None  # every held hash is pinned: the block is not kept
        slot = self.host.pop(victim)
        if self.num_disk_blocks and victim not in self.stored and victim not in self.pending:
            self._spill(victim, slot)
        return slot

    def _spill(self, h: bytes, slot: int) -> None:
        while len(self.stored) + len(self.pending) >= self.num_disk_blocks:
            if not self._delete_oldest():
                return  # every file is still being written or read
        self.pending.add(h)
        self.ops.append((TierOp.SPILL, slot, self._key(h)))
        self.counts["spilled"] += 1

    def _delete_oldest(self) -> bool:
        """Delete the least recently used stored hash not being read; False if there is none."""
        h = next((h for h in self.stored if h not in self.loading), None)
        if h is None:
            return False
        del self.stored[h]
        self.ops.append((TierOp.DELETE, self._key(h), -1))
        self.counts["deleted"] += 1
        return True

    def check(self) -> None:
        """Raise AssertionError if a slot is lost or doubled, or a bound is broken."""
        held = list(self.host.values()) + list(self.loading.values()) + self.free_slots
        assert sorted(held) == list(range(self.num_host_blocks)), "a host slot is lost or held twice"
        assert not set(self.host) & set(self.loading), "a hash is both held and loading"
        assert not set(self.stored) & self.pending, "a hash is both stored and pending"
        assert len(self.stored) + len(self.pending) <= self.num_disk_blocks, "the disk bound is broken"
        assert set(self.loading) <= set(self.stored), "a hash loads from no file"
