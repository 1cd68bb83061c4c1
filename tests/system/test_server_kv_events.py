"""KV cache events from a whole ``pagedserve serve`` (the session's float32 server on the tiny
model, ``--kv-events-config`` on ipc sockets in its folder): a router that replays the stream from
its start holds the blocks of a prompt the server answered, with that prompt's tokens, before the
same prefix comes again, and the server then reports those tokens as cached."""

from __future__ import annotations

import time

import pytest
import zmq

from services.scheduler.block_manager import hash_block
from services.scheduler.kv_cache_events import hash_int
from tests.doubles.vllm_kv_events import AllBlocksCleared, BlockStored, apply, decode_batch

pytestmark = pytest.mark.slow  # the session's float32 server

BLOCK_SIZE = 16  # the server's default --block-size
DEADLINE_S = 30.0  # guards against a hang only
END = (-1).to_bytes(8, "big", signed=True)


def _replay(ctx, endpoint: str) -> list[tuple[int, object]]:
    """Every buffered batch from seq 0, as (seq, decoded batch)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    got = []
    try:
        while True:
            assert dealer.poll(int(DEADLINE_S * 1000)), "the replay did not end"
            _, seq, payload = dealer.recv_multipart()
            if seq == END:
                return got
            got.append((int.from_bytes(seq, "big"), decode_batch(payload)))
    finally:
        dealer.close(linger=0)


def _held_after(ctx, endpoint: str, want: set[int]) -> tuple[set[int], list]:
    """A router's view from a replay of the whole stream, retried until it holds ``want`` (the
    server publishes in the loop turn after it answered)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        batches = _replay(ctx, endpoint)
        held: set[int] = set()
        for _, batch in batches:
            apply(held, batch.events)
        if want <= held or time.monotonic() > deadline:
            return held, batches
        time.sleep(0.1)


def test_a_routers_replay_holds_an_answered_prompts_blocks_before_its_prefix_comes_again(tiny_f32_server):
    from openai import OpenAI

    url, root = tiny_f32_server
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    ctx = zmq.Context()
    try:
        prompt = [(7919 * i) % 4000 + 100 for i in range(40)]  # 2 full blocks and 8 tokens, unlike other tests'
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        chain, parent = [], None
        for i in range(2):
            parent = hash_block(parent, prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            chain.append(hash_int(parent))
        held, batches = _held_after(ctx, f"ipc://{root}/kv-replay", set(chain))
        assert set(chain) <= held
        seqs = [seq for seq, _ in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # in order, none missing
        if seqs[0] == 0:  # the buffer still holds the start (10,000 batches): it said the scheduler holds nothing
            assert isinstance(batches[0][1].events[0], AllBlocksCleared)
        stored = [e for _, b in batches for e in b.events if isinstance(e, BlockStored) and chain[0] in e.block_hashes]
        [event] = stored
        assert event.parent_block_hash is None and event.block_size == BLOCK_SIZE
        assert event.token_ids[:2 * BLOCK_SIZE] == prompt[:2 * BLOCK_SIZE]
        assert all(b.data_parallel_rank == 0 for _, b in batches)
        again = client.completions.create(model="tiny", prompt=prompt[:32] + [5, 6, 7], max_tokens=2, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == 2 * BLOCK_SIZE
    finally:
        ctx.destroy(linger=0)
