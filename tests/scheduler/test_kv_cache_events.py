"""The block manager's KV cache events (``--kv-events-config``'s source): what it logs when the
prefix cache stores, evicts and drops blocks, checked against the cache's own content."""

import random

from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_cache_events import Cleared, Removed, Stored, hash_int
from tests.doubles.vllm_kv_events import apply


def _bm(num_blocks=8, block_size=4, enabled=True):
    bm = BlockManager(num_blocks=num_blocks, block_size=block_size, watermark=0.0)
    bm.cache_events.enabled = enabled
    return bm


def _held(bm) -> set[int]:
    """What a router must hold: every hash the prefix cache holds, as it travels."""
    return {hash_int(h) for h in bm.cached}


def _register(bm, seq_id, tokens, cached=()):
    full = len(tokens) // bm.block_size
    assert bm.allocate_slots(seq_id, len(tokens), cached_blocks=cached)
    hashes = bm.prefix_hashes(tokens, full)
    bm.cache_full_blocks(seq_id, hashes, tokens)
    return hashes


def test_a_sequences_new_full_blocks_make_one_stored_event_with_their_tokens_and_parent():
    bm = _bm()
    tokens = list(range(10, 23))  # 13 tokens: 3 full blocks of 4, one partial
    hashes = _register(bm, 0, tokens)
    [event] = bm.cache_events.drain()
    assert isinstance(event, Stored)
    assert event.block_hashes == [hash_int(h) for h in hashes] and event.parent_block_hash is None
    assert event.token_ids == tokens[:12] and event.block_size == 4 and event.medium == "GPU"
    # a second sequence with the same first 2 blocks and a new third: only the third is stored, its parent the second
    other = tokens[:8] + [99, 98, 97, 96]
    hits = bm.match_prefix(bm.prefix_hashes(other, 3), len(other) + 1)
    assert hits == bm.block_tables[0][:2]
    other_hashes = _register(bm, 1, other, cached=hits)
    [event] = bm.cache_events.drain()
    assert event.block_hashes == [hash_int(other_hashes[2])]
    assert event.parent_block_hash == hash_int(hashes[1]) and event.token_ids == [99, 98, 97, 96]
    assert apply(set(), [Stored([hash_int(h) for h in hashes], None, [], 4)] + [event]) == _held(bm)


def test_evicted_blocks_are_removed_and_a_reset_clears_everything():
    bm = _bm(num_blocks=4)
    first = _register(bm, 0, list(range(8)))  # 2 cached blocks once freed
    bm.free(0)
    held = apply(set(), bm.cache_events.drain())
    assert held == {hash_int(h) for h in first} == _held(bm)
    assert bm.allocate_slots(1, 16)  # the whole pool: both cached blocks are evicted, tail first
    [event] = bm.cache_events.drain()
    assert isinstance(event, Removed) and sorted(event.block_hashes) == sorted(hash_int(h) for h in first)
    assert apply(held, [event]) == set() == _held(bm)
    bm.cache_full_blocks(1, bm.prefix_hashes(list(range(100, 116)), 4), list(range(100, 116)))
    bm.reset()
    assert [type(e) for e in bm.cache_events.drain()] == [Cleared]  # what was stored before is moot


def test_disabled_the_log_records_nothing():
    bm = _bm(num_blocks=2, enabled=False)
    _register(bm, 0, list(range(8)))
    bm.free(0)
    assert bm.allocate_slots(1, 8)  # evicts both
    bm.reset()
    assert bm.cache_events.events == []


def test_replaying_the_events_always_gives_the_caches_hashes_under_sharing_cow_and_eviction():
    """Random admissions with shared prefixes (cache hits), forks written past their shared partial
    block (copy-on-write), frees (cached blocks), evictions and a reset: after every operation the
    events so far, applied by a router, hold exactly the hashes the prefix cache holds."""
    rng = random.Random(4)
    bm = _bm(num_blocks=12)
    held: set[int] = set()
    live: dict[int, list[int]] = {}
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    for step in range(300):
        op = rng.random()
        seq_id = step + 1
        if op < 0.45:
            tokens = rng.choice(stems)[:rng.randrange(4, 13)] + [rng.randrange(50) for _ in range(rng.randrange(6))]
            hits = bm.match_prefix(bm.prefix_hashes(tokens, len(tokens) // 4), len(tokens))
            if bm.allocate_slots(seq_id, len(tokens), cached_blocks=hits):
                bm.cache_full_blocks(seq_id, bm.prefix_hashes(tokens, len(tokens) // 4), tokens)
                live[seq_id] = tokens
            else:
                bm.free(seq_id)
        elif op < 0.6 and live:
            parent = rng.choice(sorted(live))
            bm.fork(parent, seq_id)
            tokens = live[parent] + [rng.randrange(50) for _ in range(3)]  # written past the shared block: COW
            if bm.allocate_slots(seq_id, len(tokens), num_computed_tokens=len(live[parent])):
                bm.cache_full_blocks(seq_id, bm.prefix_hashes(tokens, len(tokens) // 4), tokens)
                live[seq_id] = tokens
            else:
                bm.free(seq_id)
        elif op < 0.995 and live:
            victim = rng.choice(sorted(live))
            bm.free(victim)
            del live[victim]
        else:
            bm.reset()
            live = {}
        apply(held, bm.cache_events.drain())
        bm.check_integrity()
        assert held == _held(bm), f"step {step}"
    assert bm.take_copies(), "copy-on-write was never in play"
