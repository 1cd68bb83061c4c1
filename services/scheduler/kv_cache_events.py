"""The prefix cache's content changes, as vLLM's KV cache events (``--kv-events-config``), for
external KV-aware routers. Plain Python, no I/O.

Not the playground's log (``kv_events.py``: copies, evictions and swaps by block id, for the
block map): this one speaks in content hashes, what a router can match against its own hash of a
prompt, and ``kv_events_zmq.py`` puts it on the wire in vLLM's format.

Contract: while ``enabled`` is False (the default) every method returns at once, so the block
manager pays one attribute test per block event. Enabled:
- ``stored`` notes a full block whose hash the prefix cache now holds (its hash, its parent's,
  its token ids); a block whose parent is the last block of the event before extends that event,
  so the consecutive blocks one sequence registers in one step make one ``BlockStored``, as vLLM's.
- ``removed`` notes a hash the cache dropped (an evicted block); consecutive ones make one event.
- ``cleared`` notes that the whole cache is gone (the pool was reset): the events before it are
  dropped, as no consumer needs them any more.
- ``drain`` hands the events over, oldest first, and empties the log.
Replaying the events in order on an empty set (add on stored, discard on removed, empty on
cleared) gives exactly the set of hashes the prefix cache holds (``hash_int`` of each).

Hashes travel as ints: the first 8 bytes of our 128-bit BLAKE2b chain hash, big-endian unsigned
(vLLM sends ints, or bytes since 0.11; llm-d and Dynamo read both as a 64-bit int).
``medium`` says which tier: ``DEVICE_MEDIUM`` ("GPU", vLLM's name for the engine's own pool, also
on a CPU host), and a lower tier (host memory, disk) passes its own name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

DEVICE_MEDIUM = "GPU"  # vLLM's MEDIUM_GPU: the pool the engine computes in


def hash_int(block_hash: bytes) -> int:
    """The hash a block travels with: its first 8 bytes as a big-endian unsigned int."""
    return int.from_bytes(block_hash[:8], "big")


@dataclass
class Stored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = DEVICE_MEDIUM


@dataclass
class Removed:
    block_hashes: list[int]
    medium: str = DEVICE_MEDIUM


@dataclass
class Cleared:
    pass


@dataclass
class KvCacheEventLog:
    enabled: bool = False
    events: list = field(default_factory=list)

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids: Sequence[int], block_size: int,
               medium: str = DEVICE_MEDIUM) -> None:
        if not self.enabled:
            return
        h, p = hash_int(block_hash), None if parent is None else hash_int(parent)
        last = self.events[-1] if self.events else None
        if (isinstance(last, Stored) and last.medium == medium and last.block_size == block_size
                and p is not None and last.block_hashes[-1] == p):
            last.block_hashes.append(h)
            last.token_ids.extend(map(int, token_ids))
        else:
            self.events.append(Stored([h], p, list(map(int, token_ids)), block_size, medium))

    def removed(self, block_hash: bytes, medium: str = DEVICE_MEDIUM) -> None:
        if not self.enabled:
            return
        last = self.events[-1] if self.events else None
        if isinstance(last, Removed) and last.medium == medium:
            last.block_hashes.append(hash_int(block_hash))
        else:
            self.events.append(Removed([hash_int(block_hash)], medium))

    def cleared(self) -> None:
        if self.enabled:
            self.events = [Cleared()]

    def drain(self) -> list:
        events, self.events = self.events, []
        return events

