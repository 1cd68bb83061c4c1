"""The KV events' ZMQ publisher against vLLM's own definitions: a SUB socket receives its frames,
msgspec with vLLM's Structs (tests/doubles/vllm_kv_events.py) decodes them, and the replay socket
answers as vLLM's does; plus ``--kv-events-config``'s parsing and the -dp offsets."""

import time

import msgspec
import pytest
import zmq

from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_cache_events import hash_int
from services.scheduler.kv_events_zmq import KvEventsPublisher
from shared import kv_events_config
from shared.kv_events_config import KvEventsConfig, offset_endpoint
from tests.doubles.vllm_kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

DEADLINE_S = 10.0  # guards against a hang only


def _config(tmp_path, **kw):
    return KvEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/ev",
                          replay_endpoint=f"ipc://{tmp_path}/replay", topic="kv@pod@model", **kw)


class Subscriber:
    """A router's side, as vLLM's subscriber example does it."""

    def __init__(self, ctx, endpoint, topic):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)

    def sync(self, pub, bm):
        """Publish AllBlocksCleared until one arrives (a SUB's subscription reaches the PUB late)."""
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            bm.cache_events.cleared()
            pub.publish(bm.cache_events)
            if self.sub.poll(50):
                return self.recv()
        raise AssertionError("the subscriber never received a batch")

    def recv(self):
        assert self.sub.poll(int(DEADLINE_S * 1000)), "no batch"
        topic, seq, payload = self.sub.recv_multipart()
        return topic, seq, payload


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _bm():
    bm = BlockManager(num_blocks=4, block_size=4, watermark=0.0)
    bm.cache_events.enabled = True
    return bm


def test_frames_decode_with_vllms_structs_and_carry_the_caches_blocks(tmp_path, ctx):
    pub = KvEventsPublisher(_config(tmp_path), data_parallel_rank=3, ctx=ctx)
    sub = Subscriber(ctx, pub.endpoint, "kv@pod@model")
    bm = _bm()
    _, seq0, _ = sub.sync(pub, bm)
    while sub.sub.poll(100):  # the sync's extra batches, if any
        _, seq0, _ = sub.recv()
    tokens = list(range(30, 39))  # 2 full blocks and one token
    assert bm.allocate_slots(0, len(tokens))
    hashes = bm.prefix_hashes(tokens, 2)
    bm.cache_full_blocks(0, hashes, tokens)
    assert pub.publish(bm.cache_events) == int.from_bytes(seq0, "big") + 1
    assert pub.publish(bm.cache_events) is None  # no events: no batch
    bm.free(0)
    assert bm.allocate_slots(1, 16)  # evicts both
    pub.publish(bm.cache_events)
    topic, seq, payload = sub.recv()
    assert topic == b"kv@pod@model" and len(seq) == 8 and int.from_bytes(seq, "big") == int.from_bytes(seq0, "big") + 1
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 3 and abs(batch.ts - time.time()) < 600
    [stored] = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [hash_int(h) for h in hashes] and stored.parent_block_hash is None
    assert stored.token_ids == tokens[:8] and stored.block_size == 4 and stored.medium == "GPU"
    assert stored.lora_id is None and stored.lora_name is None and stored.group_idx == 0
    _, seq2, payload = sub.recv()
    [removed] = decode_batch(payload).events
    assert isinstance(removed, BlockRemoved) and int.from_bytes(seq2, "big") == int.from_bytes(seq, "big") + 1
    assert sorted(removed.block_hashes) == sorted(stored.block_hashes) and removed.medium == "GPU"
    pub.close()


def test_the_payload_is_vllms_positional_batch_of_tagged_maps(tmp_path, ctx):
    """Decoded with plain msgpack, as Dynamo's and llm-d's decoders read it: [ts, [events], rank]."""
    import msgpack

    pub = KvEventsPublisher(_config(tmp_path), ctx=ctx)
    bm = _bm()
    bm.cache_events.cleared()
    pub.publish(bm.cache_events)
    seq, payload = pub.buffer[-1]
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and rank == 0 and events == [{"type": "AllBlocksCleared"}]
    assert isinstance(decode_batch(payload).events[0], AllBlocksCleared)
    with pytest.raises(msgspec.ValidationError):  # the reference decoder is strict: a map batch is refused
        decode_batch(msgpack.packb({"ts": ts, "events": events, "data_parallel_rank": rank}))
    pub.close()


def test_replay_returns_the_buffered_batches_from_the_asked_seq_then_the_end_marker(tmp_path, ctx):
    pub = KvEventsPublisher(_config(tmp_path, buffer_steps=3), ctx=ctx)
    bm = _bm()
    for _ in range(5):
        bm.cache_events.cleared()
        pub.publish(bm.cache_events)
    req = ctx.socket(zmq.DEALER)  # a REQ takes one reply per request; a replay is many
    req.connect(pub.replay_endpoint)
    end = (-1).to_bytes(8, "big", signed=True)

    def replay(start: int) -> list[tuple[int, bytes]]:
        req.send_multipart((b"", start.to_bytes(8, "big")))  # the ROUTER sees (identity, b"", start)
        got, deadline = [], time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            pub.serve_replay()
            while req.poll(20):
                empty, seq, payload = req.recv_multipart()
                assert empty == b""
                if seq == end:
                    assert payload == b""
                    return got
                got.append((int.from_bytes(seq, "big"), payload))
        raise AssertionError("no end marker")

    got = replay(1)
    assert [s for s, _ in got] == [2, 3, 4]  # only the last buffer_steps are kept
    assert all(isinstance(decode_batch(p).events[0], AllBlocksCleared) for _, p in got)
    assert [s for s, _ in replay(4)] == [4]
    assert replay(9) == []
    pub.close()
    req.close(linger=0)


def test_config_is_vllms_with_its_defaults_and_one_line_errors():
    off = KvEventsConfig()
    assert (off.enable_kv_cache_events, off.publisher, off.endpoint, off.replay_endpoint, off.buffer_steps,
            off.hwm, off.max_queue_size, off.topic) == (False, "null", "tcp://*:5557", None, 10_000, 100_000,
                                                         100_000, "")
    on = kv_events_config.parse('{"enable_kv_cache_events": true, "topic": "kv-events"}')
    assert on.publisher == "zmq" and on.publishes and on.topic == "kv-events"
    assert not kv_events_config.parse('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    assert kv_events_config.parse(None) is None
    for bad, says in (("{", "not JSON"), ("[1]", "JSON object"), ('{"endpoit": "x"}', "unknown keys"),
                      ('{"publisher": "kafka"}', "publisher"), ('{"hwm": 0}', "hwm"),
                      ('{"buffer_steps": "10"}', "buffer_steps"), ('{"endpoint": "udp://x:1"}', "endpoint"),
                      ('{"enable_kv_cache_events": 1}', "enable_kv_cache_events")):
        with pytest.raises(ValueError, match=says) as info:
            kv_events_config.parse(bad)
        assert "\n" not in str(info.value)


def test_the_flag_stops_the_scheduler_command_at_start(capsys):
    from services.cli import main

    with pytest.raises(SystemExit) as info:
        main(["scheduler", "--kv-events-config", '{"publisher": "kafka"}'])
    assert info.value.code == 2 and "publisher must be one of null, zmq" in capsys.readouterr().err


def test_replicas_offset_their_ports_as_vllms_do(tmp_path, ctx):
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    assert offset_endpoint(None, 1) is None
    pub = KvEventsPublisher(_config(tmp_path), data_parallel_rank=1, ctx=ctx)
    assert pub.endpoint == f"ipc://{tmp_path}/ev_dp1" and pub.replay_endpoint == f"ipc://{tmp_path}/replay_dp1"
    pub.close()
    taken = ctx.socket(zmq.PUB)
    taken.bind("tcp://*:0")
    port = taken.getsockopt(zmq.LAST_ENDPOINT).decode().rpartition(":")[2]
    with pytest.raises(ValueError, match="cannot open") as info:  # a port in use: a one-line start error
        KvEventsPublisher(KvEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"), ctx=ctx)
    assert "\n" not in str(info.value)
    taken.close(linger=0)


def test_dp_replicas_schedulers_get_their_rank():
    from services.cli import build_parser
    from services.data_parallel import plan_replicas

    args = build_parser().parse_args(["serve", "-dp", "2", "--kv-events-config", '{"enable_kv_cache_events": true}'])
    plans = plan_replicas(args, "/tmp/x")
    assert [p.scheduler_argv() for p in plans] == [["--data-parallel-rank", "0"], ["--data-parallel-rank", "1"]]
    sched = build_parser().parse_args(["scheduler", "--data-parallel-rank", "1"])
    assert sched.data_parallel_rank == 1
    one = plan_replicas(build_parser().parse_args(["serve"]), "/tmp/x")
    assert one[0].scheduler_argv() == []


def test_serve_refuses_replicas_whose_offset_ports_collide():
    from services.cli import build_parser
    from services.data_parallel import plan_replicas

    config = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
    with pytest.raises(ValueError, match="at least 2 apart"):  # replica 1 would publish on 5558
        plan_replicas(build_parser().parse_args(["serve", "-dp", "2", "--kv-events-config", config]), "/tmp/x")
    assert len(plan_replicas(build_parser().parse_args(["serve", "--kv-events-config", config]), "/tmp/x")) == 1
    apart = config.replace("5558", "5567")
    assert len(plan_replicas(build_parser().parse_args(["serve", "-dp", "2", "--kv-events-config", apart]),
                             "/tmp/x")) == 2
