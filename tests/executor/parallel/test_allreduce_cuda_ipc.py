"""CUDA IPC communicator: two ranks on one GPU open each other's buffers and get the same sums.

Runs wherever a CUDA device is present; skipped elsewhere. The ranks are spawned (CUDA cannot be
used in a forked child), so the parent never initialises CUDA itself.
"""

import pytest
import torch

from tests.doubles.rank_group import RankGroup, check_sums, group_segments, new_group_id, sums_worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device: the CUDA IPC all-reduce needs a GPU")

CASES = [(1, "float32"), (576, "float32"), (64 * 576 + 3, "float32"), (3 * 2**20 + 5, "float32"),
         (577, "bfloat16"), (2**20 + 1, "bfloat16"), (577, "float16")]


@pytest.mark.parametrize("world_size", [2, 3])
def test_cuda_ipc_sums_on_one_gpu(world_size, tmp_path):
    group_id = new_group_id()
    spec = {"group_id": group_id, "store_path": str(tmp_path / "store"), "device": "cuda:0",
            "slot_bytes": 2**20}  # 1 MiB slots: the two largest cases cross several chunks
    group = RankGroup(sums_worker, world_size, "cuda_ipc", spec, CASES, method="spawn")
    check_sums(group, CASES, timeout_s=300)
    assert group_segments(group_id) == []
