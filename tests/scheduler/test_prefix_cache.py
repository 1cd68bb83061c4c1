"""Prefix cache and copy-on-write in the block manager, with exact blocks, orders and counts."""

import torch

from services.scheduler.block_manager import BlockManager, hash_block
from tests.doubles.engine import InProcessEngine, tiny_llama


def _bm(num_blocks=10):
    return BlockManager(num_blocks=num_blocks, block_size=4, watermark=0.0)


def test_hash_chain_covers_the_whole_prefix():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4]) and len(a) == 16  # 128 bits
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    bm = _bm()
    hashes = bm.prefix_hashes(list(range(1, 11)), 2)
    assert hashes == [a, hash_block(a, [5, 6, 7, 8])]


def test_hit_after_first_request_finished_reuses_exact_blocks():
    bm = _bm()
    tokens = list(range(1, 11))  # 10 tokens: 2 full blocks + 2
    hashes = bm.prefix_hashes(tokens, 2)
    assert bm.match_prefix(hashes, len(tokens)) == []
    assert bm.allocate_slots(0, 10)
    assert bm.block_tables[0] == [0, 1, 2]
    bm.cache_full_blocks(0, hashes)
    bm.free(0)
    assert list(bm.evictable) == [1, 0] and list(bm.free_queue)[-1] == 2  # tail first, partial block freed
    assert bm.num_free_blocks == 10 and bm.num_cached_blocks == 2
    bm.check_integrity()
    hits = bm.match_prefix(hashes, len(tokens))
    assert hits == [0, 1]
    assert bm.allocate_slots(1, 11, num_computed_tokens=8, cached_blocks=hits)
    assert bm.block_tables[1][:2] == [0, 1] and bm.ref_counts[0] == 1 and not bm.evictable
    bm.check_integrity()


def test_last_prompt_token_is_always_computed():
    bm = _bm()
    tokens = list(range(1, 9))  # exactly 2 full blocks
    hashes = bm.prefix_hashes(tokens, 2)
    bm.allocate_slots(0, 8)
    bm.cache_full_blocks(0, hashes)
    assert bm.match_prefix(hashes, len(tokens)) == [0]  # the second block is recomputed


def test_lru_eviction_only_when_no_free_block_is_left():
    bm = _bm(num_blocks=4)
    for seq_id, base in ((0, 100), (1, 200)):
        bm.allocate_slots(seq_id, 4)
        bm.cache_full_blocks(seq_id, bm.prefix_hashes([base + i for i in range(4)], 1))
    bm.free(1)  # block 1 becomes cached first
    bm.free(0)  # then block 0
    assert list(bm.evictable) == [1, 0] and list(bm.free_queue) == [2, 3]
    assert bm.allocate_slots(2, 8) and bm.block_tables[2] == [2, 3]  # free blocks first
    assert bm.allocate_slots(3, 4) and bm.block_tables[3] == [1]  # then least recently freed
    assert list(bm.evictable) == [0] and len(bm.cached) == 1
    bm.check_integrity()


def test_copy_on_write_exactly_for_a_shared_partial_block():
    bm = _bm()
    bm.allocate_slots(0, 6)  # blocks [0, 1]; block 1 holds 2 of 4 tokens
    bm.fork(0, 1)
    assert bm.ref_counts[:2] == [2, 2]
    # seq 1 writes position 6, inside shared block 1: copy it.
    assert bm.allocate_slots(1, 7, num_computed_tokens=6)
    assert bm.take_copies() == [(1, 2)]
    assert bm.block_tables[1] == [0, 2] and bm.ref_counts[:3] == [2, 1, 1]
    # seq 0 writes position 6 into block 1, now its own: no copy.
    assert bm.allocate_slots(0, 7, num_computed_tokens=6)
    assert bm.take_copies() == []
    bm.check_integrity()


def test_no_copy_when_writing_past_shared_full_blocks():
    bm = _bm()
    bm.allocate_slots(0, 8)  # two full blocks
    bm.fork(0, 1)
    assert bm.allocate_slots(1, 9, num_computed_tokens=8)
    assert bm.take_copies() == [] and bm.block_tables[1] == [0, 1, 2]
    bm.free(0)
    bm.free(1)
    assert bm.num_free_blocks == 10
    bm.check_integrity()


def _greedy(model, prompts, enable_prefix_caching, num_blocks=96):
    engine = InProcessEngine(model, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64,
                             enable_prefix_caching=enable_prefix_caching)
    tokens, cached = {}, {}
    for wave in (prompts[:3], prompts[3:]):  # the second wave arrives after the first finished
        for i, p in enumerate(wave):
            engine.add(f"{len(tokens) + i}", p, temperature=0.0, max_tokens=12, ignore_eos=True)
        tokens.update(engine.run())
    for rid, outs in engine.outputs.items():
        cached[rid] = outs[-1].num_cached_tokens
    assert engine.blocks.num_used_blocks == 0
    return tokens, cached, engine.blocks


def test_greedy_outputs_equal_with_prefix_caching_on_and_off():
    model = tiny_llama(seed=5)
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(1, 128, (10,), generator=gen).tolist()  # 2.5 blocks of 4
    prompts = [shared + torch.randint(1, 128, (n,), generator=gen).tolist() for n in (1, 3, 6)]
    prompts += [shared + [7], shared[:6] + [9, 9, 9], shared + prompts[2][10:], prompts[1][:12]]
    on, cached_on, blocks = _greedy(model, prompts, True)
    off, cached_off, _ = _greedy(model, prompts, False)
    assert on == off
    assert all(c == 0 for c in cached_off.values())
    assert cached_on["3"] == 8 and cached_on["4"] == 4  # whole shared blocks only
    assert cached_on["5"] == 12  # identical prompt of 16 tokens: all but the last block
    assert cached_on["6"] == 8  # 12-token prefix of an earlier prompt: the last token is recomputed
    assert blocks.num_hit_tokens > 0


def test_serve_flags_turn_prefix_caching_off_under_either_name():
    """``--no-prefix-caching`` and vLLM's ``--no-enable-prefix-caching`` reach the scheduler;
    ``--enable-prefix-caching`` (vLLM's) is the default."""
    from services.cli import build_parser
    from services.launcher import scheduler_argv

    parse = build_parser().parse_args
    for flags, off in [([], False), (["--no-prefix-caching"], True), (["--no-enable-prefix-caching"], True),
                       (["--enable-prefix-caching"], False)]:
        args = parse(["serve", *flags])
        assert args.enable_prefix_caching is (False if off else (True if flags else None))
        assert ("--no-prefix-caching" in scheduler_argv(args)) is off
