"""Block manager on tiny pools, with exact block ids, free-queue order and counts."""

import pytest

from services.scheduler.block_manager import AllocStatus, BlockManager
from services.scheduler.contiguous import ContiguousBlockManager


def test_blocks_taken_one_at_a_time_and_freed_tail_first():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.0)
    assert bm.allocate_slots(0, 5)  # 5 tokens -> 2 blocks
    assert bm.block_tables[0] == [0, 1]
    assert bm.allocate_slots(0, 8)  # still 2 blocks
    assert bm.block_tables[0] == [0, 1]
    assert bm.allocate_slots(0, 9)
    assert bm.block_tables[0] == [0, 1, 2]
    assert bm.allocate_slots(1, 4)
    assert bm.block_tables[1] == [3]
    assert bm.slot(0, 8) == 2 * 4 + 0 and bm.slot(1, 3) == 3 * 4 + 3
    bm.free(0)
    assert list(bm.free_queue) == [4, 5, 6, 7, 8, 9, 2, 1, 0]  # tail first
    bm.check_integrity()
    bm.free(1)
    assert bm.num_free_blocks == 10
    bm.check_integrity()


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4, watermark=0.0)
    assert bm.allocate_slots(0, 12)
    assert not bm.allocate_slots(1, 8)
    assert 1 not in bm.block_tables and bm.num_free_blocks == 1
    bm.check_integrity()


def test_admission_answers_ok_later_never_with_watermark():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.2)  # 2 blocks kept free
    assert bm.can_admit(32, 32) is AllocStatus.OK
    assert bm.can_admit(33, 33) is AllocStatus.NEVER
    bm.allocate_slots(0, 20)  # 5 blocks
    assert bm.can_admit(12, 12) is AllocStatus.OK
    assert bm.can_admit(13, 13) is AllocStatus.LATER


def test_fork_shares_blocks_and_counts():
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.0)
    bm.allocate_slots(0, 6)
    bm.fork(0, 1)
    assert bm.block_tables[1] == [0, 1] and bm.ref_counts[:2] == [2, 2]
    bm.check_integrity()
    bm.free(0)
    assert bm.ref_counts[:2] == [1, 1] and bm.num_free_blocks == 8
    bm.free(1)
    assert bm.num_free_blocks == 10
    bm.check_integrity()


def test_swap_out_moves_a_shared_block_once_and_back():
    bm = BlockManager(num_blocks=6, block_size=4, watermark=0.0, num_cpu_blocks=4)
    bm.allocate_slots(0, 6)  # blocks [0, 1]
    bm.fork(0, 1)
    bm.allocate_slots(1, 9)  # seq 1: [0, 1, 2]
    assert bm.can_swap_out([0, 1])
    out = bm.swap_out([0, 1])
    assert out == [(0, 0), (1, 1), (2, 2)]  # (device, cpu), shared blocks once
    assert bm.cpu_tables == {0: [0, 1], 1: [0, 1, 2]}
    assert bm.cpu_ref_counts == [2, 2, 1, 0]
    assert bm.num_free_blocks == 6 and not bm.block_tables
    bm.check_integrity()
    bm.allocate_slots(7, 4)  # someone else takes a device block meanwhile
    assert bm.can_swap_in([0, 1])
    back = bm.swap_in([0, 1])
    assert [c for c, _ in back] == [0, 1, 2]
    new_ids = dict(back)
    assert bm.block_tables[1] == [new_ids[0], new_ids[1], new_ids[2]]
    assert bm.ref_counts[new_ids[0]] == 2 and bm.ref_counts[new_ids[2]] == 1
    assert len(bm.cpu_free_queue) == 4
    bm.check_integrity()


def test_swap_needs_room():
    bm = BlockManager(num_blocks=6, block_size=4, watermark=0.0, num_cpu_blocks=1)
    bm.allocate_slots(0, 8)
    assert not bm.can_swap_out([0])
    with pytest.raises(RuntimeError, match="2 blocks: 1 free"):
        bm.swap_out([0])


def test_free_swapped_sequence():
    bm = BlockManager(num_blocks=4, block_size=4, watermark=0.0, num_cpu_blocks=4)
    bm.allocate_slots(0, 8)
    bm.swap_out([0])
    bm.free_swapped(0)
    assert len(bm.cpu_free_queue) == 4 and bm.num_free_blocks == 4
    bm.check_integrity()


def test_contiguous_reserves_a_first_fit_run_that_never_grows():
    cm = ContiguousBlockManager(num_blocks=10, block_size=4, watermark=0.0)
    assert cm.allocate_slots(0, 12)  # blocks 0..2
    assert cm.allocate_slots(1, 8)  # blocks 3..4
    assert cm.allocate_slots(2, 16)  # blocks 5..8
    assert cm.block_tables == {0: [0, 1, 2], 1: [3, 4], 2: [5, 6, 7, 8]}
    assert cm.allocate_slots(0, 12) and not cm.allocate_slots(0, 13)  # no growth
    cm.free(0)
    cm.free(2)
    # free runs: 0..2 and 5..9. Eight blocks are free, but no run of six (external fragmentation).
    assert cm.num_free_blocks == 8
    assert cm.can_admit(24, 24) is AllocStatus.LATER
    assert cm.can_admit(12, 12) is AllocStatus.OK
    assert cm.allocate_slots(3, 12) and cm.block_tables[3] == [0, 1, 2]  # first fit
    assert cm.allocate_slots(4, 20) and cm.block_tables[4] == [5, 6, 7, 8, 9]
    cm.check_integrity()
