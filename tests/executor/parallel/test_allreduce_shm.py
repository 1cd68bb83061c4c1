"""The shared-memory communicator: sums equal torch.sum over ranks, no deadlock, failures named."""

import os

import msgpack
import pytest
import torch

from services.executor.parallel.base import GroupError, SingleRank, failed_on_any_rank
from services.executor.parallel.rendezvous import exchange_handles, file_store
from services.executor.parallel.segment import cleanup_group, segment_name
from services.executor.parallel.peer_flags import WaitPolicy
from services.executor.parallel.shm import ShmCommunicator
from tests.doubles.rank_group import (
    RankGroup, check_sums, group_segments, make_communicator, new_group_id, sums_worker,
)

SIZES = [1, 2, 7, 576, 64 * 576 + 3, 2**18 + 1, 3 * 2**20 + 5]  # the largest is 12 MiB of float32
SLOT_BYTES = 256 * 2**10  # small slots: every size above 64 Ki floats crosses several chunks


@pytest.fixture
def spec(tmp_path):
    group_id = new_group_id()
    yield {"group_id": group_id, "store_path": str(tmp_path / "store"), "slot_bytes": SLOT_BYTES}
    assert group_segments(group_id) == [], "a segment was left in /dev/shm"


@pytest.mark.parametrize("world_size", [2] + [pytest.param(n, marks=pytest.mark.slow) for n in (3, 4)])
def test_sums_equal_torch_sum(world_size, spec):
    cases = [(n, "float32") for n in SIZES] + [(n, d) for n in (1, 577, 2**17 + 3) for d in ("bfloat16", "float16")]
    check_sums(RankGroup(sums_worker, world_size, "shm", spec, cases), cases)


def _failures_worker(rank, world_size, report, spec):
    comm = make_communicator("shm", rank, world_size, spec)
    mine = [[False, True, False, False], [False, False, True, False]][rank]  # each rank fails a different one
    report({"agreed": failed_on_any_rank(comm, mine), "none": failed_on_any_rank(comm, [])})
    comm.close()


def test_failed_on_any_rank_is_the_or_over_ranks(spec):
    """What the KV tiers and migration use so that every rank drops a block file one rank failed."""
    group = RankGroup(_failures_worker, 2, spec)
    assert group.join(60) == [0, 0], group.messages
    for rank in range(2):
        got = group.wait_for(rank, "agreed")
        assert got["agreed"] == [False, True, True, False] and got["none"] == []
    assert failed_on_any_rank(SingleRank(), [True, False]) == [True, False]
    assert failed_on_any_rank(None, [False]) == [False]


def test_default_slot_size_multi_mib(spec):
    spec.pop("slot_bytes")
    cases = [(576, "float32"), (3 * 2**20 + 5, "float32"), (2**21 + 1, "bfloat16")]
    check_sums(RankGroup(sums_worker, 2, "shm", spec, cases), cases)


def _back_to_back_worker(rank, world_size, report, spec, num_calls):
    comm = make_communicator("shm", rank, world_size, spec)
    small, large = torch.empty(1, 576), torch.empty(64, 576)
    num_correct = 0
    for i in range(num_calls):
        x = small if i % 2 else large
        x.fill_((rank + 1) * (i % 5 + 1))
        comm.all_reduce_(x)
        num_correct += bool((x == world_size * (world_size + 1) // 2 * (i % 5 + 1)).all())
        if i % 100 == 0:
            num_correct -= comm.gather(x, dst=0) is None and rank == 0  # the gather must return on rank 0
    comm.close()
    report({"num_correct": num_correct})


@pytest.mark.slow  # a thousand all-reduces between processes
def test_thousand_back_to_back_calls(spec):
    group = RankGroup(_back_to_back_worker, 3, spec, 1000)
    assert group.join(120) == [0, 0, 0], group.messages
    assert [group.wait_for(r, "num_correct")["num_correct"] for r in range(3)] == [1000] * 3


def _loop_until_error_worker(rank, world_size, report, spec):
    comm = make_communicator("shm", rank, world_size, spec)
    report({"connected": True, "segments_left": group_segments(spec["group_id"])})
    x = torch.ones(64, 576)
    for _ in range(10**7):
        comm.all_reduce_(x.fill_(1.0))
    report({"finished": True})  # not reached: the test kills a rank


def test_killed_rank_is_named_and_nothing_left(spec):
    group = RankGroup(_loop_until_error_worker, 3, spec)
    for rank in range(3):
        group.wait_for(rank, "connected")
    group.kill(1)
    codes = group.join(60)  # a survivor left spinning would fail here, not hang
    assert codes[1] == -9 and codes[0] == codes[2] == 1, group.messages
    for rank in (0, 2):
        error = group.wait_for(rank, "error")
        assert error["error_type"] == "GroupError" and error["blamed_rank"] == 1, error
        assert "rank 1" in error["error"], error
    # fixture: no segment of the group is left in /dev/shm


def _die_at_start_worker(rank, world_size, report, spec):
    comm = ShmCommunicator(spec["group_id"], rank, world_size, spec["slot_bytes"])
    handles = exchange_handles(file_store(spec["store_path"], world_size), rank, world_size, comm.local_handle())
    if rank == 1:
        os.kill(os.getpid(), 9)  # its segment is still named in /dev/shm
    comm.connect(handles)


def test_rank_dying_before_connect_is_named_and_cleaned_up(spec):
    group = RankGroup(_die_at_start_worker, 2, spec)
    assert group.join(60) == [1, -9]
    error = group.wait_for(0, "error")
    assert error["blamed_rank"] == 1 and "died" in error["error"], error


def _hang_worker(rank, world_size, report, spec):
    comm = make_communicator("shm", rank, world_size, spec)
    if rank == 1:  # hangs until rank 0 has timed out (the test says so), however slow the machine
        import time

        deadline = time.monotonic() + 120
        while not os.path.exists(spec["store_path"] + ".rank0-gave-up") and time.monotonic() < deadline:
            time.sleep(0.01)
    comm.all_reduce(torch.ones(8))  # rank 1 still gets this sum: rank 0 had published its part
    comm.all_reduce(torch.ones(8))  # but rank 0 has given up on the group since


def test_hung_rank_times_out_named(spec):
    spec["timeout_s"] = 1.0
    group = RankGroup(_hang_worker, 2, spec)
    assert "within 1 s" in group.wait_for(0, "error")["error"]
    open(spec["store_path"] + ".rank0-gave-up", "w").close()
    assert group.join(60) == [1, 1]
    assert [group.wait_for(r, "error")["blamed_rank"] for r in (0, 1)] == [1, 1]
    assert "within 1 s" in group.wait_for(1, "error")["error"]  # rank 1 is told why


def _abort_worker(rank, world_size, report, spec):
    comm = make_communicator("shm", rank, world_size, spec)
    comm.all_reduce(torch.ones(8))
    if rank == 1:
        comm.abort("step 7 failed: out of memory")  # e.g. the executor's step raised half-way
        return
    comm.all_reduce(torch.ones(8))


def test_abort_names_the_rank_and_reason(spec):
    spec["timeout_s"] = 600.0  # rank 0 must learn it from the abort, not from a timeout
    group = RankGroup(_abort_worker, 2, spec)
    assert group.join(60) == [1, 0]
    error = group.wait_for(0, "error")
    assert error["blamed_rank"] == 1 and "rank 1 failed: step 7 failed: out of memory" in error["error"], error


def _mismatch_worker(rank, world_size, report, spec):
    comm = make_communicator("shm", rank, world_size, spec)
    comm.all_reduce(torch.ones(10 + rank))


def test_mismatched_tensors_raise(spec):
    group = RankGroup(_mismatch_worker, 2, spec)
    assert group.join(60) == [1, 1]
    assert "expected 10 of torch.float32" in group.wait_for(0, "error")["error"]


def test_single_rank_group_in_process(tmp_path):
    group_id = new_group_id()
    comm = ShmCommunicator(group_id, 0, 1, slot_bytes=1024)
    handle = comm.local_handle()
    fields = msgpack.unpackb(handle, raw=False)  # plain msgpack, no pickle
    assert fields["segment"] == segment_name(group_id, 0) and fields["kind"] == "shm"
    comm.connect(exchange_handles(file_store(str(tmp_path / "s"), 1), 0, 1, handle))
    assert group_segments(group_id) == []  # unlinked as soon as every rank mapped it
    x = torch.arange(1000, dtype=torch.float32)
    assert torch.equal(comm.all_reduce(x), x)
    t = torch.arange(12, dtype=torch.bfloat16).view(3, 4).t()  # not contiguous
    assert comm.all_reduce_(t) is t and torch.equal(t, torch.arange(12, dtype=torch.bfloat16).view(3, 4).t())
    assert torch.equal(comm.gather(x)[0], x)
    with pytest.raises(TypeError, match="int64"):
        comm.all_reduce(torch.ones(3, dtype=torch.int64))
    comm.close()
    with pytest.raises(GroupError, match="closed"):
        comm.barrier()


def test_cleanup_group_and_names():
    group_id = new_group_id()
    comm = ShmCommunicator(group_id, 1, 2, slot_bytes=1024)
    assert group_segments(group_id) == [segment_name(group_id, 1)]
    assert cleanup_group(group_id) == [segment_name(group_id, 1)]
    assert group_segments(group_id) == []
    comm.close()
    with pytest.raises(ValueError, match="group id"):
        segment_name("../etc", 0)
    with pytest.raises(ValueError, match="rank 2 is outside a group of 2"):
        ShmCommunicator(group_id, 2, 2)


def test_rendezvous_names_missing_ranks(tmp_path):
    with pytest.raises(GroupError, match=r"ranks \[1, 2\] did not publish") as info:
        exchange_handles(file_store(str(tmp_path / "s"), 3), 0, 3, b"x", timeout_s=0.3)
    assert info.value.rank == 1


def test_wait_policy_validated():
    with pytest.raises(ValueError):
        WaitPolicy(timeout_s=0)


def _header() -> memoryview:
    return memoryview(bytearray(4096)).cast("q")


def test_a_peer_that_arrived_then_closed_is_not_blamed():
    """The race a loaded machine hits: rank 0 sees rank 1 short of the epoch; before rank 0 looks at
    its status, rank 1 publishes it, finishes and closes. Only a peer still short is blamed."""
    from services.executor.parallel.peer_flags import PeerFlags
    from services.executor.parallel.segment import STATUS_CLOSED, W_EPOCH, W_STATUS

    flags = PeerFlags(_header(), new_group_id(), 0, WaitPolicy())
    peer = _header()
    flags.peers.append((1, peer, {"pid": os.getpid(), "pid_start": 0, "pid_ns": 0}))
    lagging = list(flags.peers)  # seen short of epoch 1 ...
    peer[W_EPOCH], peer[W_STATUS] = 1, STATUS_CLOSED  # ... then it arrived, and closed
    flags._check_lagging(lagging, W_EPOCH, 1, "collective 1", waited_s=1e9)
    assert flags.error is None
    with pytest.raises(GroupError, match="rank 1 closed while rank 0 waited for it at collective 2") as info:
        flags._check_lagging(lagging, W_EPOCH, 2, "collective 2", waited_s=0.0)
    assert info.value.rank == 1


@pytest.mark.parametrize("arrives", [True, False])
def test_a_peer_that_arrives_closes_and_exits_during_the_check_is_not_blamed(monkeypatch, arrives):
    """The same race a step later: rank 1 publishes, closes and exits while rank 0 checks it. Only
    a peer that is gone without having arrived is blamed as dead."""
    from services.executor.parallel import peer_flags as flags_module
    from services.executor.parallel.peer_flags import PeerFlags
    from services.executor.parallel.segment import STATUS_CLOSED, W_EPOCH, W_STATUS

    flags = PeerFlags(_header(), new_group_id(), 0, WaitPolicy())
    peer = _header()
    flags.peers.append((1, peer, {"pid": 12345, "pid_start": 0, "pid_ns": 0}))
    lagging = list(flags.peers)  # seen short of epoch 1

    def finishes_and_exits(pid, start_ticks, pid_namespace):  # whenever rank 0 asks, it is gone
        if arrives:
            peer[W_EPOCH], peer[W_STATUS] = 1, STATUS_CLOSED
        return False

    monkeypatch.setattr(flags_module, "process_alive", finishes_and_exits)
    if arrives:
        flags._check_lagging(lagging, W_EPOCH, 1, "collective 1", waited_s=0.0)
        assert flags.error is None
    else:
        with pytest.raises(GroupError, match="rank 1 \\(pid 12345\\) died; rank 0 was at collective 1"):
            flags._check_lagging(lagging, W_EPOCH, 1, "collective 1", waited_s=0.0)
