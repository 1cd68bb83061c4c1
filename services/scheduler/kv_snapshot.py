"""One ``KvSnapshot`` of the scheduler's block pool, for the playground's map. Plain Python, no I/O.

Built only while a frontend watches (``kv_publisher``). Reads the block manager's tables as the
truth about ownership: every sequence holding blocks, device or CPU, sorted by sequence id, with
the request and choice it belongs to; then drains the block manager's event log.
"""

from __future__ import annotations

import numpy as np

from shared.messages import KvSnapshot

from .scheduler import Scheduler


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
    events, num_dropped = blocks.events.drain()
    return KvSnapshot(
        snapshot_id=snapshot_id,
        block_size=blocks.block_size,
        ref_counts=np.asarray(blocks.ref_counts, np.int32),
        cached=np.fromiter((h is not None for h in blocks.block_hashes), bool, blocks.num_blocks),
        cpu_ref_counts=np.asarray(blocks.cpu_ref_counts, np.int32).reshape(-1),
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
