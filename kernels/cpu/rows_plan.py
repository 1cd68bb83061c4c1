"""The plan of a rows-attention call (``kernels/cpu/decode.py``), from the rows' metadata alone:
the order of the (row, KV head) tasks, whether the call runs on the calling thread or in
parallel, and whether long contexts are split into partitions. It is the same for every layer of
a step, so a caller makes it once per step (``plan_rows``) and runs it in each layer
(``decode.run_plan``).

- Rows go to the threads in ``balanced_order`` (numba gives each thread an equal contiguous share
  of the tasks). Calls with little work (``MAX_SERIAL_WORK``) run on the calling thread: waking
  the others costs more. A small batch gives too few tasks to keep every thread busy; contexts
  longer than ``MIN_PARTITION_SIZE`` are then split into partitions, run as (row, KV head,
  partition) tasks and merged with the log-sum-exp rule (shorter ones measured no faster split).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

# tokens: the automatic partitions are never shorter. Measured at batch 1 (bf16, 2 threads, after a
# torch matmul with OMP_WAIT_POLICY=PASSIVE, as in a model step): unpartitioned was as fast or
# faster than any partition size up to 8,192 tokens (136 us against 132-143 at 8,192; 55 against
# 63-79 at 1,024); at 16,384 tokens partitions of 4,096 took 11% less, at 32,768 12%.
MIN_PARTITION_SIZE = 4096
# (token, KV head) pairs up to which a call runs on the calling thread: waking the others for a
# parallel region costs ~50 us (OMP_WAIT_POLICY=PASSIVE, after a torch matmul, as in a model
# step). Measured, 2 threads, bf16 (fp32 alike): batch 1 x 256 tokens 22 us serial against 70 in
# parallel; 8 x 256 (6,144 pairs) 64 against 89; 16 x 256 (12,288) 111 against 112; 64 x 64 158
# against 123.
MAX_SERIAL_WORK = 6144


def auto_partitions(num_rows: int, num_kv_heads: int, num_threads: int) -> int:
    """How many partitions the entry point splits the longest row's context into by itself: 1
    (none) unless the (row, KV head) tasks are too few to keep ``num_threads`` threads evenly
    busy (fewer than 4 per thread), then enough for ~4 tasks per thread. The partitions are never
    shorter than ``MIN_PARTITION_SIZE`` tokens, so shorter contexts stay in one."""
    tasks = num_rows * num_kv_heads
    if num_threads <= 1 or tasks >= 4 * num_threads:
        return 1
    return -(-4 * num_threads // tasks)


def balanced_order(lens: np.ndarray) -> np.ndarray:
    """The rows (indices into ``lens``) in task order: by length, alternately from the longest and
    the shortest end. numba hands each thread an equal contiguous share of the tasks, so that share
    then holds as much work as the others' (prefill rows grow by one position each: in their own
    order, the last thread would get the longest rows)."""
    by_len = np.argsort(lens, kind="stable")
    order = np.empty_like(by_len)
    half = (len(by_len) + 1) // 2
    order[0::2] = by_len[::-1][:half]
    order[1::2] = by_len[:len(by_len) - half]
    return order


class RowsPlan(NamedTuple):
    """What ``attend_rows`` derives from the rows' metadata alone (``plan_rows``): the same for every
    layer of a step, so a caller may make it once per step and run it in each layer (``run_plan``)."""

    rows: np.ndarray  # [N] int32, in task order: the query (and out) row
    seqs: np.ndarray  # [N] int32: its block-table row
    lens: np.ndarray  # [N] int32: the positions it attends to
    block_tables: np.ndarray  # [S, max_blocks] int32
    serial: bool  # on the calling thread
    partition_size: int  # tokens per partition; 0: unpartitioned
    row_ids: np.ndarray | None  # the rows computed (others' ``out`` left as it was); None: all


def plan_rows(block_tables, row_seqs, row_lens, num_kv_heads: int, block_size: int,
              partition_size: int | None = None, num_threads: int | None = None,
              partition_threads: int | None = None, row_ids=None) -> RowsPlan | None:
    """The plan of an ``attend_rows`` call (its arguments but the tensors' data); None for no rows."""
    num_rows = len(row_lens) if row_ids is None else len(row_ids)
    if num_rows == 0:
        return None
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    lens = np.ascontiguousarray(row_lens, dtype=np.int32)
    seqs = np.ascontiguousarray(row_seqs, dtype=np.int32)
    ids = None if row_ids is None else np.ascontiguousarray(row_ids, dtype=np.int32)
    if ids is not None:
        seqs, lens = seqs[ids], lens[ids]
    threads = numba.get_num_threads() if num_threads is None else num_threads
    sized_for = threads if partition_threads is None else partition_threads
    total = int(lens[0]) if num_rows == 1 else int(lens.sum())  # (numpy's sum: 1.3 us)
    small = total * num_kv_heads <= MAX_SERIAL_WORK
    serial = threads <= 1 or small
    if serial:
        rows = np.arange(num_rows, dtype=np.int32) if ids is None else ids
    else:
        order = balanced_order(lens).astype(np.int32)
        seqs, lens = seqs[order], lens[order]
        rows = order if ids is None else ids[order]
    if partition_size is None:
        num_parts = 1 if small else auto_partitions(num_rows, num_kv_heads, sized_for)
        partition_size = 0 if num_parts == 1 else max(-(-int(lens.max()) // num_parts),
                                                      MIN_PARTITION_SIZE)
    partition_size = -(-partition_size // block_size) * block_size
    if not (partition_size > 0 and partition_size < int(lens.max())):  # max only where partitions may be
        partition_size = 0
    return RowsPlan(rows, seqs, lens, block_tables, serial, partition_size, ids)
