"""The torch.distributed (gloo) communicator gives the same sums and gathers as shared memory."""

import pytest

from services.executor.parallel.torch_dist import parse_init_addr
from tests.rank_group import RankGroup, free_port, sums_worker

CASES = [(1, "float32"), (577, "float32"), (64 * 576, "float32"), (2**20 + 3, "float32"),
         (577, "bfloat16"), (577, "float16")]


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_sums_equal_torch_sum(world_size):
    group = RankGroup(sums_worker, world_size, "torch", {"port": free_port()}, CASES)
    assert group.join(120) == [0] * world_size, group.messages
    for rank, messages in enumerate(group.messages):
        results = [m for m in messages if "numel" in m]
        assert [(m["numel"], m["dtype"]) for m in results] == CASES
        for m in results:
            what = f"rank {rank}, {m['numel']} x {m['dtype']}"
            assert m["shape_ok"] and m["input_unchanged"] and m["in_place_ok"], what
            assert m["close"], f"{what}: max error {m['max_err']} against torch.sum"
            if world_size == 2:  # a sum of two is the same in any order
                assert m["exact_rank_order"], what
        assert any(m.get("gather_ok") for m in messages), f"rank {rank}: gather"
    for i in range(len(CASES)):
        assert len({[m for m in msgs if "numel" in m][i]["digest"] for msgs in group.messages}) == 1


def test_parse_init_addr():
    assert parse_init_addr("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert parse_init_addr("[::1]:29500") == ("::1", 29500)
    for bad in ("10.0.0.1", ":29500", "host:port", "host:70000"):
        with pytest.raises(ValueError, match="--dist-init-addr must be HOST:PORT"):
            parse_init_addr(bad)
