"""What the KV cache events (``--kv-events-config``) cost, in the block manager and the publisher
alone (no model).

    python -m loadtest.bench.kv_events [--requests 2000] [--prefix 2000] [--tail 200] [--block-size 16] [--rounds 5]

Prints figures only (no assertions):
1. the block manager's time per request (admit with prefix-cache hits, register its blocks, free)
   over a stream of requests sharing a ``--prefix``-token beginning with a ``--tail`` of their own,
   in a pool that holds a hundredth of them (so cached blocks are evicted), events off and on (on: drained
   after every request, as the scheduler does each loop turn) in alternating rounds, each round and
   the medians, and the events made;
2. the publisher's time per batch (msgpack in vLLM's format and the PUB send, nobody subscribed)
   and its bytes, for a batch with one request's ``BlockStored`` and one with its ``BlockRemoved``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from loadtest.common.machine_state import cpu_description
from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_cache_events import KvCacheEventLog
from services.scheduler.kv_events_zmq import KvEventsPublisher, encode_batch
from shared.kv_events_config import KvEventsConfig


def _stream(num_requests: int, prefix: int, tail: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(32000) for _ in range(prefix)]
    return [shared + [rng.randrange(32000) for _ in range(tail)] for _ in range(num_requests)]


def block_manager_time(prompts: list[list[int]], block_size: int, events_on: bool) -> tuple[float, dict]:
    """Seconds per request, and the number of each kind of event made."""
    per_request = -(-len(prompts[0]) // block_size)
    bm = BlockManager(per_request * max(2, len(prompts) // 100), block_size, watermark=0.0)
    bm.cache_events.enabled = events_on
    counts = {"Stored": 0, "Removed": 0, "Cleared": 0}
    began = time.perf_counter()
    for seq_id, tokens in enumerate(prompts):
        full = len(tokens) // block_size
        hashes = bm.prefix_hashes(tokens, full)
        hits = bm.match_prefix(hashes, len(tokens))
        assert bm.allocate_slots(seq_id, len(tokens), cached_blocks=hits)
        bm.cache_full_blocks(seq_id, hashes, tokens if bm.cache_events.enabled else ())
        bm.free(seq_id)
        for event in bm.cache_events.drain():
            counts[type(event).__name__] += 1
    return (time.perf_counter() - began) / len(prompts), counts


def publisher_time(tokens: list[int], block_size: int, repeats: int = 200) -> list[tuple[str, float, int]]:
    """(batch, seconds per publish, payload bytes) for one request's stored and removed events."""
    bm = BlockManager(2 * -(-len(tokens) // block_size), block_size, watermark=0.0)
    log = bm.cache_events
    log.enabled = True
    hashes = bm.prefix_hashes(tokens, len(tokens) // block_size)
    assert bm.allocate_slots(0, len(tokens))
    bm.cache_full_blocks(0, hashes, tokens)
    stored = log.drain()
    bm.free(0)
    assert bm.allocate_slots(1, bm.num_blocks * block_size)  # evicts every cached block
    removed = log.drain()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pub = KvEventsPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp}/ev"))
        for name, events in ((f"BlockStored of {len(hashes)} blocks", stored),
                             (f"BlockRemoved of {len(hashes)} blocks", removed)):
            batch = KvCacheEventLog(enabled=True)
            began = time.perf_counter()
            for _ in range(repeats):
                batch.events = list(events)
                pub.publish(batch)
            rows.append((name, (time.perf_counter() - began) / repeats, len(encode_batch(events, 0.0, 0))))
        pub.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.kv_events", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prefix", type=int, default=2000)
    parser.add_argument("--tail", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    prompts = _stream(args.requests, args.prefix, args.tail)
    print(f"CPU: {cpu_description()}", flush=True)  # the figures depend on it
    print(f"block manager, {args.requests} requests of {args.prefix} shared + {args.tail} own tokens:")
    offs, ons = [], []
    for _ in range(args.rounds):  # alternating, so that a busy spell of the machine hits both
        offs.append(block_manager_time(prompts, args.block_size, False)[0])
        on, counts = block_manager_time(prompts, args.block_size, True)
        ons.append(on)
    off, on = statistics.median(offs), statistics.median(ons)
    print(f"  events off: {off * 1e6:8.1f} us per request (rounds: {', '.join(f'{t * 1e6:.0f}' for t in offs)})")
    print(f"  events on:  {on * 1e6:8.1f} us per request (rounds: {', '.join(f'{t * 1e6:.0f}' for t in ons)}), "
          f"medians {on / off:.2f}x; events made: {counts}")
    print("publisher (msgpack, vLLM's format, PUB send):")
    for name, seconds, size in publisher_time(prompts[0], args.block_size):
        print(f"  {name}: {seconds * 1e6:8.1f} us per batch, {size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
