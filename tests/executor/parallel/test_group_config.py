"""open_group: the configuration an executor rank gets, validated, and the communicator it opens."""

import pytest
import torch

from services.executor.parallel.group import GroupConfig, open_group
from tests.doubles.rank_group import RankGroup, free_port, group_segments, new_group_id


def _group_worker(rank, world_size, report, config_fields):
    comm = open_group(GroupConfig(rank=rank, world_size=world_size, **config_fields))
    total = comm.all_reduce(torch.full((3,), float(rank + 1)))
    report({"kind": comm.kind, "total": total.tolist()})
    comm.close()


@pytest.mark.parametrize("all_reduce", ["auto", "torch"])
def test_open_group_connects_the_ranks(all_reduce, tmp_path):
    group_id = new_group_id()
    fields = {"all_reduce": all_reduce, "group_id": group_id, "store_path": str(tmp_path / "store"),
              "dist_init_addr": f"127.0.0.1:{free_port()}"}
    group = RankGroup(_group_worker, 3, fields)
    assert group.join(120) == [0, 0, 0], group.messages
    for rank in range(3):
        msg = group.wait_for(rank, "kind")
        assert msg == {"kind": "shm" if all_reduce == "auto" else "torch", "total": [6.0, 6.0, 6.0]}
    assert group_segments(group_id) == []


def test_single_rank_needs_nothing():
    comm = open_group(GroupConfig())
    assert comm.kind == "single" and torch.equal(comm.all_reduce(torch.ones(2)), torch.ones(2))


@pytest.mark.parametrize("fields,match", [
    ({"rank": 2, "world_size": 2}, "--rank 2 must be in"),
    ({"world_size": 2, "all_reduce": "nccl"}, "--all-reduce must be one of auto, shm, torch"),
    ({"world_size": 4, "num_nodes": 3}, "--nnodes 3 must divide --tensor-parallel-size 4"),
    ({"world_size": 4, "num_nodes": 2}, "needs --dist-init-addr"),
    ({"world_size": 2}, "needs a group id"),
    ({"world_size": 4, "num_nodes": 2, "all_reduce": "shm", "group_id": "g", "store_path": "s"}, "one host"),
])
def test_bad_configurations_name_the_flag(fields, match):
    with pytest.raises(ValueError, match=match):
        GroupConfig(**fields)
