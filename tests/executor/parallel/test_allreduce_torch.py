"""The torch.distributed (gloo) communicator gives the same sums and gathers as shared memory."""

import pytest

from services.executor.parallel.torch_dist import parse_init_addr
from tests.doubles.rank_group import RankGroup, check_sums, free_port, sums_worker

CASES = [(1, "float32"), (577, "float32"), (64 * 576, "float32"), (2**20 + 3, "float32"),
         (577, "bfloat16"), (577, "float16")]


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_sums_equal_torch_sum(world_size):
    group = RankGroup(sums_worker, world_size, "torch", {"port": free_port()}, CASES)
    check_sums(group, CASES, exact=world_size == 2)  # a sum of two is the same in any order


def test_parse_init_addr():
    assert parse_init_addr("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert parse_init_addr("[::1]:29500") == ("::1", 29500)
    for bad in ("10.0.0.1", ":29500", "host:port", "host:70000"):
        with pytest.raises(ValueError, match="--dist-init-addr must be HOST:PORT"):
            parse_init_addr(bad)
