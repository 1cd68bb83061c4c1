"""The offload tiers' books (``kv_tiers.TierIndex``), directly: LRU in the host tier, spills to the
disk tier and its bound, loads reserving slots, failed loads forgetting the file, and the order of
the moves the executors are sent."""

import random

import pytest

from services.scheduler.kv_tiers import TierIndex, TierOp


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def ops(tiers: TierIndex) -> list[tuple]:
    """The queued moves with keys spelled out."""
    rows, keys = tiers.take_ops()
    out = []
    for kind, a, b in rows.tolist():
        kind = TierOp(kind)
        if kind in (TierOp.LOAD, TierOp.DELETE):
            a = keys[a]
        if kind == TierOp.SPILL:
            b = keys[b]
        out.append((kind.name, a, b))
    return out


def test_host_tier_is_lru_and_a_held_hash_is_only_touched():
    t = TierIndex(2)
    t.offload(h(1), 10)
    t.offload(h(2), 11)
    t.offload(h(1), 12)  # the same bytes again: no copy, h(1) becomes the most recent
    t.offload(h(3), 13)  # evicts h(2), the least recently used; no disk tier: gone
    assert ops(t) == [("OFFLOAD", 10, 0), ("OFFLOAD", 11, 1), ("OFFLOAD", 13, 1)]
    assert [t.where(h(i)) for i in (1, 2, 3)] == ["host", None, "host"]
    t.reload(h(1), 7)
    assert ops(t) == [("RELOAD", 0, 7)]
    t.check()


def test_host_victims_spill_to_disk_and_count_only_once_stored():
    t = TierIndex(1, num_disk_blocks=2)
    t.offload(h(1), 10)
    t.offload(h(2), 11)  # h(1) spills from slot 0 before h(2) is copied into it
    assert ops(t) == [("OFFLOAD", 10, 0), ("SPILL", 0, h(1)), ("OFFLOAD", 11, 0)]
    assert t.where(h(1)) is None  # being written: not a hit yet
    t.on_stored(h(1), True)
    assert t.where(h(1)) == "disk"
    t.offload(h(3), 12)  # h(2) spills, then its write fails (a full disk): forgotten
    t.on_stored(h(2), False)
    assert t.where(h(2)) is None and t.where(h(1)) == "disk"
    t.check()


def test_the_disk_bound_holds_by_deleting_the_least_recently_used():
    t = TierIndex(1, num_disk_blocks=2)
    for i in range(6):
        t.offload(h(i), i)
        for key in list(t.pending):
            t.on_stored(key, True)
        assert len(t.stored) + len(t.pending) <= 2
        t.check()
    assert list(t.stored) == [h(3), h(4)]
    assert [op for op in ops(t) if op[0] == "DELETE"] == [("DELETE", h(i), -1) for i in (0, 1, 2)]


def test_a_load_reserves_its_slot_and_a_failed_one_forgets_the_file():
    t = TierIndex(2, num_disk_blocks=4)
    t.adopt([h(1), h(2)])  # found at start, oldest first
    assert t.load(h(1)) and t.load(h(2))
    assert not t.load(h(1))  # already on its way
    assert t.where(h(1)) == "loading" and t.num_loadable() == 0
    t.offload(h(9), 5)  # no slot may be taken from a load: nothing copied
    assert ops(t) == [("LOAD", h(1), 0), ("LOAD", h(2), 1)]
    t.on_loaded(h(1), True)
    t.on_loaded(h(2), False)  # corrupt, truncated or foreign: never served, never asked for again
    assert t.where(h(1)) == "host" and t.where(h(2)) is None
    t.check()


def test_adopting_more_files_than_the_bound_deletes_the_oldest():
    t = TierIndex(1, num_disk_blocks=2)
    t.adopt([h(1), h(2), h(3)])
    assert list(t.stored) == [h(2), h(3)]
    assert ops(t) == [("DELETE", h(1), -1)]


def test_reset_host_keeps_the_files_and_forgets_the_rest():
    t = TierIndex(2, num_disk_blocks=4)
    t.adopt([h(1)])
    t.load(h(1))
    t.offload(h(2), 3)
    t.reset_host()
    assert t.where(h(1)) == "disk" and t.where(h(2)) is None and t.take_ops()[0].shape == (0, 3)
    t.on_loaded(h(1), True)  # a result from before the reset: ignored
    assert t.where(h(1)) == "disk"
    t.check()


@pytest.mark.parametrize("seed", range(3))
def test_random_traffic_keeps_the_books(seed):
    rng = random.Random(seed)
    t = TierIndex(rng.randint(1, 5), rng.randint(0, 6))
    for _ in range(400):
        key = h(rng.randint(0, 12))
        choice = rng.random()
        if choice < 0.4:
            t.offload(key, rng.randint(0, 7))
        elif choice < 0.55 and t.where(key) == "host":
            t.reload(key, rng.randint(0, 7))
        elif choice < 0.7:
            t.load(key)
        elif choice < 0.85 and t.loading:
            t.on_loaded(rng.choice(sorted(t.loading)), rng.random() < 0.8)
        elif t.pending:
            t.on_stored(rng.choice(sorted(t.pending)), rng.random() < 0.8)
        t.check()
