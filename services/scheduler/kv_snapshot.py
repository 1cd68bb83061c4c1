"""One ``KvSnapshot`` of the scheduler's block pool, for the playground's map. Plain Python, no I/O.

Built only while a frontend watches (``kv_publisher``), in time proportional to the blocks in use
and in the prefix cache, not to the pool's size: the block manager's tables are the truth about
ownership (every sequence holding blocks, device or CPU, sorted by sequence id, with the request
and choice it belongs to) and a block's count is the number of tables holding it. The block
manager's event log is drained into it. A table entry ``NULL_BLOCK`` (-1: freed out of the sliding
window) goes out as it is in ``table_block_ids`` and is no used block.
"""

from __future__ import annotations

import numpy as np

from shared.messages import KvSnapshot

from .scheduler import Scheduler
from .sliding_window import NULL_BLOCK


def _used(tables: dict[int, list[int]], ref_counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The blocks the tables hold, ascending, and their counts."""
    block_ids = sorted({b for table in tables.values() for b in table if b != NULL_BLOCK})
    return np.array(block_ids, np.int32), np.array([ref_counts[b] for b in block_ids], np.int32)


def build_kv_snapshot(sched: Scheduler, snapshot_id: int) -> KvSnapshot:
    """The pool as it is now, with the moves logged since the previous snapshot (the log is emptied)."""
    blocks = sched.blocks
    by_seq_id = {s.seq_id: s for group in sched.groups.values() for s in group.seqs}
    tables = [(seq_id, False, t) for seq_id, t in blocks.block_tables.items()]
    tables += [(seq_id, True, t) for seq_id, t in blocks.cpu_tables.items()]
    tables.sort(key=lambda row: row[0])
    request_ids, choice_idxs, num_computed = [], [], []
    for seq_id, _, _ in tables:
        seq = by_seq_id.get(seq_id)  # always found while the scheduler's state is consistent
        request_ids.append(seq.request_id if seq is not None else "")
        choice_idxs.append(seq.choice_idx if seq is not None else -1)
        num_computed.append(seq.num_computed_tokens if seq is not None else 0)
    lengths = [len(t) for _, _, t in tables]
    used_ids, used_counts = _used(blocks.block_tables, blocks.ref_counts)
    cpu_used_ids, cpu_used_counts = _used(blocks.cpu_tables, blocks.cpu_ref_counts)
    events, num_dropped = blocks.events.drain()
    return KvSnapshot(
        snapshot_id=snapshot_id,
        block_size=blocks.block_size,
        num_blocks=blocks.num_blocks,
        num_cpu_blocks=blocks.num_cpu_blocks,
        used_block_ids=used_ids,
        used_ref_counts=used_counts,
        cached_block_ids=np.array(sorted(blocks.cached.values()), np.int32),
        cpu_used_block_ids=cpu_used_ids,
        cpu_used_ref_counts=cpu_used_counts,
        seq_ids=np.array([seq_id for seq_id, _, _ in tables], np.int64),
        request_ids=request_ids,
        choice_idxs=np.array(choice_idxs, np.int32),
        on_cpu=np.array([on_cpu for _, on_cpu, _ in tables], bool),
        num_computed_tokens=np.array(num_computed, np.int32),
        table_starts=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32),
        table_block_ids=np.array([b for _, _, t in tables for b in t], np.int32),
        events=events,
        num_events_dropped=num_dropped,
        stats=sched.engine_stats(),
    )
