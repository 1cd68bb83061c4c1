"""KV cache events from a running engine (the offline ``EngineCore`` on a tiny random Llama, the
scheduler process's publisher after every step): a router that applies what it receives over ZMQ
holds, after every step, exactly the blocks the engine's prefix cache holds, so it knows a second
request's prefix is cached before the engine says so."""

import time

import zmq

from services.scheduler.kv_cache_events import hash_int
from services.scheduler.kv_events_zmq import KvEventsPublisher
from shared.kv_events_config import KvEventsConfig
from tests.doubles.engine import InProcessEngine, tiny_llama
from tests.doubles.vllm_kv_events import apply, decode_batch

DEADLINE_S = 10.0  # guards against a hang only


class Router:
    """Receives every batch the publisher sends and keeps the hashes they say the engine holds."""

    def __init__(self, ctx, endpoint):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.held: set[int] = set()
        self.next_seq = 0
        self.kinds: list[str] = []

    def take(self, up_to_seq: int | None) -> None:
        """Apply the batches up to ``up_to_seq`` (None: none was sent)."""
        while up_to_seq is not None and self.next_seq <= up_to_seq:
            assert self.sub.poll(int(DEADLINE_S * 1000)), f"batch {self.next_seq} never came"
            _, seq, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            assert seq == self.next_seq, "a batch was lost"
            batch = decode_batch(payload)
            self.kinds += [type(e).__name__ for e in batch.events]
            apply(self.held, batch.events)
            self.next_seq = seq + 1


def _connected(pub, engine, router):
    """Publish AllBlocksCleared until the router gets one: a SUB's subscription reaches the PUB late."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        engine.blocks.cache_events.cleared()
        seq = pub.publish(engine.blocks.cache_events)
        if router.sub.poll(50):
            router.next_seq = seq  # whatever came before this one was a sync batch too
            router.take(seq)
            while router.sub.poll(50):
                router.take(router.next_seq)
            return
    raise AssertionError("the router never connected")


def _run(engine, pub, router):
    while engine.has_work():
        engine.step()
        router.take(pub.publish(engine.blocks.cache_events))
        assert router.held == {hash_int(h) for h in engine.blocks.cached}


def test_a_second_request_with_the_same_prefix_is_preceded_by_its_blocks_events(tmp_path):
    ctx = zmq.Context()
    engine = InProcessEngine(tiny_llama(), num_blocks=14, block_size=4, max_num_batched_tokens=64)
    engine.blocks.cache_events.enabled = True
    pub = KvEventsPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/ev"), ctx=ctx)
    router = Router(ctx, pub.endpoint)
    try:
        _connected(pub, engine, router)
        system = list(range(1, 13))  # 3 full blocks of 4 shared by both requests
        first = system + [40, 41]
        engine.add("a", first, temperature=0.0, max_tokens=6, ignore_eos=True)
        engine.add("forks", [90 + i for i in range(6)], temperature=1.0, n=2, max_tokens=7, ignore_eos=True, seed=1)
        _run(engine, pub, router)
        second = system + [50, 51, 52]
        wanted = [hash_int(h) for h in engine.blocks.prefix_hashes(second, 3)]
        assert set(wanted) <= router.held  # the router can route it here before it is sent
        engine.add("b", second, temperature=0.0, max_tokens=4, ignore_eos=True)
        _run(engine, pub, router)
        assert engine.outputs["b"][-1].num_cached_tokens == 12  # and the engine does hit those blocks
        assert "BlockRemoved" not in router.kinds
        engine.add("long", list(range(60, 100)), temperature=0.0, max_tokens=8, ignore_eos=True)  # 12 of 14 blocks
        _run(engine, pub, router)
        assert "BlockRemoved" in router.kinds and not set(wanted) <= router.held  # evicted, and the router knows
    finally:
        pub.close()
        ctx.destroy(linger=0)
