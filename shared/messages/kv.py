"""Block-pool snapshots, the playground's map: a frontend's ``KvWatch``, the scheduler's
``KvSnapshot`` answers, and the ``KvEventKind`` of each block move they report."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import ClassVar

import numpy as np

from shared.messages.control import EngineStats


@dataclass
class KvWatch:
    """frontend -> scheduler: send ``KvSnapshot`` to this frontend (``on``) or stop.

    A frontend repeats ``on`` about once a second while any of its clients watches; the scheduler
    lets a watch lapse when it has not been renewed for a few seconds, so a frontend that dies or
    whose ``off`` is lost costs nothing for long."""

    TAG: ClassVar[int] = 40
    on: bool


class KvEventKind(IntEnum):
    """What happened to a block, in ``KvSnapshot.events`` rows ``(kind, src, dst)``."""

    COPY = 0  # copy-on-write: device block src copied into device block dst
    EVICT = 1  # cached device block src lost its prefix-cache entry to new content (dst -1)
    SWAP_OUT = 2  # device block src copied to CPU block dst
    SWAP_IN = 3  # CPU block src copied to device block dst


@dataclass
class KvSnapshot:
    """scheduler -> the frontends that watch: the block pool at one moment (``/v1/kv/events``).

    Sparse, so that its size follows the blocks in use, not the pool's: a block not listed in
    ``used_block_ids`` has count 0. A block's owners are the sequences whose tables hold it:
    sequence ``i``'s table is ``table_block_ids[table_starts[i]:table_starts[i + 1]]``, in the CPU
    pool when ``on_cpu[i]`` (swapped out), else on the device. ``events`` are the block moves since
    the previous snapshot (oldest first; ``num_events_dropped`` more did not fit the scheduler's log).
    """

    TAG: ClassVar[int] = 41
    snapshot_id: int
    block_size: int
    num_blocks: int
    num_cpu_blocks: int
    used_block_ids: np.ndarray  # [U] int32: device blocks held by some table, ascending
    used_ref_counts: np.ndarray  # [U] int32: their reference counts
    cached_block_ids: np.ndarray  # [C] int32: device blocks with a prefix-cache entry (count 0: cached, free)
    cpu_used_block_ids: np.ndarray  # [V] int32: CPU blocks held by some table, ascending
    cpu_used_ref_counts: np.ndarray  # [V] int32
    seq_ids: np.ndarray  # [S] int64
    request_ids: list[str]  # [S]
    choice_idxs: np.ndarray  # [S] int32
    on_cpu: np.ndarray  # [S] bool
    num_computed_tokens: np.ndarray  # [S] int32: tokens in the sequence's blocks
    table_starts: np.ndarray  # [S + 1] int32
    table_block_ids: np.ndarray  # [sum of table lengths] int32
    events: np.ndarray  # [E, 3] int32: (KvEventKind, src, dst)
    num_events_dropped: int
    stats: EngineStats
