"""CUDA IPC communicator: two ranks on one GPU open each other's buffers and get the same sums.

Runs wherever a CUDA device is present; skipped elsewhere. The ranks are spawned (CUDA cannot be
used in a forked child), so the parent never initialises CUDA itself.
"""

import pytest
import torch

from tests.rank_group import RankGroup, group_segments, new_group_id, sums_worker

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
    assert group.join(300) == [0] * world_size, group.messages
    for rank, messages in enumerate(group.messages):
        results = [m for m in messages if "numel" in m]
        assert [(m["numel"], m["dtype"]) for m in results] == CASES
        for m in results:
            what = f"rank {rank}, {m['numel']} x {m['dtype']}"
            assert m["shape_ok"] and m["input_unchanged"] and m["in_place_ok"], what
            assert m["close"], f"{what}: max error {m['max_err']} against torch.sum"
            assert m["exact_rank_order"], f"{what}: not the float32 rank-order sum"
        assert any(m.get("gather_ok") for m in messages), f"rank {rank}: gather"
    for i in range(len(CASES)):
        assert len({[m for m in msgs if "numel" in m][i]["digest"] for msgs in group.messages}) == 1
    assert group_segments(group_id) == []
