"""The playground's data, without processes: the block manager's event log, the snapshot builder,
its JSON form, the publisher's rules (nothing while nobody watches, at most 4 a second), the
scheduler's link tracking watchers, and the frontend's hub that never queues for a slow client."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import structlog
import zmq

from services.frontend.kv_stream import KvHub, Mailbox
from services.scheduler.block_manager import BlockManager, hash_block
from services.scheduler.frontends import FrontendLink
from services.scheduler.kv_events import KvEventLog
from services.scheduler.kv_publisher import KvPublisher
from services.scheduler.kv_snapshot import build_kv_snapshot
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.endpoints import Endpoints
from shared.kv_json import kv_snapshot_json, kv_snapshot_schema
from shared.messages import AddRequest, KvEventKind, KvSnapshot, KvWatch, SamplingParams, StepResult, decode, encode

COPY, EVICT, SWAP_OUT, SWAP_IN = (int(k) for k in KvEventKind)


# ---------------------------------------------------------------- the event log


def test_event_log_records_only_while_enabled_and_stays_bounded():
    log = KvEventLog(max_events=3)
    log.record(KvEventKind.COPY, 1, 2)
    assert log.drain()[0].shape == (0, 3)  # disabled: nothing kept
    log.set_enabled(True)
    for src in range(5):
        log.record(KvEventKind.EVICT, src)
    rows, num_dropped = log.drain()
    assert rows.tolist() == [[EVICT, 2, -1], [EVICT, 3, -1], [EVICT, 4, -1]] and num_dropped == 2
    assert log.drain()[0].shape == (0, 3) and log.num_dropped == 0  # drained
    log.record_pairs(KvEventKind.SWAP_OUT, [(7, 0), (8, 1)])
    log.set_enabled(False)  # off empties it: a later watcher never sees older moves
    log.set_enabled(True)
    assert log.drain()[0].shape == (0, 3)


def _watched(**kwargs) -> BlockManager:
    bm = BlockManager(10, 4, watermark=0.0, **kwargs)
    bm.events.set_enabled(True)
    return bm


def test_copy_on_write_is_logged_with_its_blocks():
    bm = _watched()
    assert bm.allocate_slots(0, 6)  # blocks [0, 1], the second partly filled
    bm.fork(0, 1)
    assert bm.allocate_slots(1, 7, num_computed_tokens=6)  # writes into shared block 1: copied to 2
    assert bm.block_tables[1] == [0, 2]
    rows, _ = bm.events.drain()
    assert rows.tolist() == [[COPY, 1, 2]]
    assert bm.take_copies() == [(1, 2)]  # the executors' copy is unchanged by the log


def test_unwatched_block_manager_logs_nothing():
    bm = BlockManager(10, 4, watermark=0.0)
    bm.allocate_slots(0, 6)
    bm.fork(0, 1)
    bm.allocate_slots(1, 7, num_computed_tokens=6)
    assert bm.events.drain()[0].shape == (0, 3)


def test_evictions_are_logged_least_recently_used_first():
    bm = _watched()
    bm.allocate_slots(0, 8)
    h0 = hash_block(None, [1, 2, 3, 4])
    bm.cache_full_blocks(0, [h0, hash_block(h0, [5, 6, 7, 8])])
    bm.free(0)  # tail first: block 1 becomes evictable before block 0
    assert bm.allocate_slots(1, 40)  # all ten blocks: the eight free ones, then both cached ones
    rows, _ = bm.events.drain()
    assert rows.tolist() == [[EVICT, 1, -1], [EVICT, 0, -1]]
    bm.check_integrity()


def test_swaps_are_logged_with_both_pools_blocks():
    bm = _watched(num_cpu_blocks=4)
    bm.allocate_slots(0, 8)
    bm.fork(0, 1)
    assert bm.swap_out([0, 1]) == [(0, 0), (1, 1)]  # a block shared in the group moves once
    assert bm.swap_in([0, 1]) == [(0, 2), (1, 3)]
    rows, _ = bm.events.drain()
    assert rows.tolist() == [[SWAP_OUT, 0, 0], [SWAP_OUT, 1, 1], [SWAP_IN, 0, 2], [SWAP_IN, 1, 3]]
    bm.check_integrity()


# ---------------------------------------------------------------- snapshots of a running scheduler


def _scheduler(num_blocks: int = 16, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=64, **config), BlockManager(num_blocks, 4, watermark=0.0))


def _add(sched: Scheduler, request_id: str, num_prompt: int, n: int = 1, max_tokens: int = 8) -> None:
    sampling = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                              eos_token_ids=[0])
    sched.add_request(AddRequest(request_id, np.arange(1, num_prompt + 1, dtype=np.int32), sampling, 0.0))


def _step(sched: Scheduler) -> None:
    """One step with a fake executor: token 7 for every sequence that samples."""
    step = sched.schedule()
    seq_ids = step.seq_ids[step.sample_mask]
    sched.update(StepResult(step.step_id, seq_ids, np.full(len(seq_ids), 7, np.int64)))
    sched.take_outputs()


def test_snapshot_shows_parallel_samples_sharing_the_prompt_then_copying_on_write():
    sched = _scheduler()
    sched.blocks.events.set_enabled(True)
    _add(sched, "r", num_prompt=9, n=3)  # 2 full blocks and 1 token
    _step(sched)  # prefill, then the two other samples fork from the first
    snap = build_kv_snapshot(sched, 1)
    assert snap.seq_ids.tolist() == [0, 1, 2] and snap.request_ids == ["r", "r", "r"]
    assert snap.choice_idxs.tolist() == [0, 1, 2] and not snap.on_cpu.any()
    assert snap.table_starts.tolist() == [0, 3, 6, 9]
    assert snap.table_block_ids.tolist() == [0, 1, 2] * 3
    assert snap.used_block_ids.tolist() == [0, 1, 2] and snap.used_ref_counts.tolist() == [3, 3, 3]
    assert snap.cached_block_ids.tolist() == [0, 1]  # full computed blocks enter the prefix cache
    assert snap.num_blocks == 16 and snap.num_cpu_blocks == 0
    assert snap.num_computed_tokens.tolist() == [9, 9, 9]
    assert snap.stats.num_running == 3 and snap.stats.num_blocks_used == 3
    assert snap.events.shape == (0, 3)
    _step(sched)  # the first decode: two samples copy the partial block 2 before writing
    snap = build_kv_snapshot(sched, 2)
    assert snap.events.tolist() == [[COPY, 2, 3], [COPY, 2, 4]]
    assert snap.used_block_ids.tolist() == [0, 1, 2, 3, 4] and snap.used_ref_counts.tolist() == [3, 3, 1, 1, 1]
    assert build_kv_snapshot(sched, 3).events.shape == (0, 3)  # each move is reported once


def test_snapshot_shows_a_swapped_group_in_the_cpu_pool():
    sched = Scheduler(SchedulerConfig(max_model_len=64, preemption_mode="swap"),
                      BlockManager(6, 4, watermark=0.0, num_cpu_blocks=8))
    sched.blocks.events.set_enabled(True)
    _add(sched, "old", num_prompt=8, max_tokens=12)
    _add(sched, "new", num_prompt=8, max_tokens=12)
    while not sched.swapped:
        _step(sched)
    snap = build_kv_snapshot(sched, 1)
    on_cpu = dict(zip(snap.request_ids, snap.on_cpu.tolist()))
    assert on_cpu == {"old": False, "new": True}
    view = kv_snapshot_json(snap)
    swapped = next(s for s in view["sequences"] if s["on_cpu"])
    cpu_counts = dict(zip(view["cpu_blocks"]["used_block_ids"], view["cpu_blocks"]["ref_counts"]))
    assert sorted(cpu_counts) == sorted(swapped["block_table"]) and set(cpu_counts.values()) == {1}
    assert view["cpu_blocks"]["num_blocks"] == 8
    assert "swap_out" in {e["kind"] for e in view["events"]}
    assert snap.stats.num_swapped == 1 and snap.stats.num_preemptions == 1


def test_json_form_round_trips_the_message_and_fits_its_schema():
    sched = _scheduler()
    _add(sched, "r", num_prompt=9, n=2)
    _step(sched)
    snap = decode(encode(build_kv_snapshot(sched, 5)))  # as the frontend receives it
    view = json.loads(json.dumps(kv_snapshot_json(snap)))
    _validate(view, kv_snapshot_schema())
    assert view["snapshot_id"] == 5 and view["block_size"] == 4
    assert [s["block_table"] for s in view["sequences"]] == [[0, 1, 2], [0, 1, 2]]
    assert view["blocks"]["cached_block_ids"] == [0, 1] and view["blocks"]["used_block_ids"] == [0, 1, 2]
    assert view["stats"]["num_running"] == 2


def test_snapshot_size_follows_the_blocks_in_use_not_the_pool():
    sched = Scheduler(SchedulerConfig(max_model_len=64),
                      BlockManager(1_000_000, 4, watermark=0.0, num_cpu_blocks=1_000_000))
    _add(sched, "r", num_prompt=9, n=3)
    _step(sched)
    snap = build_kv_snapshot(sched, 1)
    assert snap.num_blocks == snap.num_cpu_blocks == 1_000_000
    assert len(encode(snap)) < 2_000 and len(json.dumps(kv_snapshot_json(snap))) < 2_000


def _validate(value, schema: dict) -> None:
    """The subset of JSON Schema ``kv_snapshot_schema`` uses."""
    if "anyOf" in schema:
        errors = []
        for option in schema["anyOf"]:
            try:
                _validate(value, option)
                return
            except AssertionError as exc:
                errors.append(exc)
        raise AssertionError((value, schema, errors))
    types = schema.get("type")
    if types is not None:
        kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
                 "number": (int, float)}
        allowed = types if isinstance(types, list) else [types]
        ok = any(isinstance(value, int) and not isinstance(value, bool) if t == "integer" else
                 isinstance(value, kinds[t]) for t in allowed)
        assert ok, (value, schema)
    if "enum" in schema:
        assert value in schema["enum"]
    if "minimum" in schema:
        assert value >= schema["minimum"]
    if "maximum" in schema:
        assert value <= schema["maximum"]
    for key in schema.get("required", []):
        assert key in value, key
    for key, sub in schema.get("properties", {}).items():
        if isinstance(value, dict) and key in value:
            _validate(value[key], sub)
    if "items" in schema:
        for item in value:
            _validate(item, schema["items"])


# ---------------------------------------------------------------- the publisher: when, and for whom


class _Link:
    def __init__(self) -> None:
        self.kv_watchers: dict[bytes, float] = {}
        self.sent: list[KvSnapshot] = []

    def send_kv_snapshot(self, frame: bytes) -> None:
        self.sent.append(decode(frame))


def test_nobody_watching_costs_no_snapshot_and_no_event_log():
    sched, link = _scheduler(), _Link()
    publisher = KvPublisher(link)
    _add(sched, "r", num_prompt=9, n=3)
    for i in range(6):
        _step(sched)
        assert publisher.publish(sched, now=100.0 + i) is None
    assert publisher.num_built == 0 and link.sent == [] and sched.stats.num_kv_snapshots == 0
    assert not sched.blocks.events.enabled
    assert sched.engine_stats().num_kv_snapshots == 0


def test_watching_gets_at_most_four_a_second_and_stops_when_the_watch_ends_or_lapses():
    sched, link = _scheduler(num_blocks=64), _Link()
    publisher = KvPublisher(link)
    _add(sched, "r", num_prompt=9, n=3, max_tokens=40)
    link.kv_watchers[b"fe"] = 0.0
    now = 0.0
    for _ in range(20):  # 20 steps, 0.05 s apart: 1 s of engine time
        _step(sched)
        publisher.publish(sched, now)
        now += 0.05
    assert len(link.sent) == 4  # at t = 0, 0.25, 0.5, 0.75
    assert [s.snapshot_id for s in link.sent] == [1, 2, 3, 4] and sched.stats.num_kv_snapshots == 4
    assert sum(len(s.events) for s in link.sent) == 2  # the two copy-on-write copies, reported once
    assert publisher.publish(sched, now + 1.0) is not None  # steps ran since the last one
    idle = len(link.sent)
    for t in (1.5, 1.8, 2.2):  # nothing changes: only the heartbeat (every 2 s) goes out
        publisher.publish(sched, now + t)
    assert len(link.sent) == idle
    publisher.publish(sched, now + 3.1)
    assert len(link.sent) == idle + 1
    link.kv_watchers[b"fe"] = now + 3.1
    assert publisher.publish(sched, now + 3.1 + 5.5) is None  # not renewed for 5 s: lapsed
    assert link.kv_watchers == {} and not sched.blocks.events.enabled


def test_a_new_watcher_gets_a_snapshot_without_waiting_for_the_heartbeat():
    sched, link = _scheduler(), _Link()
    publisher = KvPublisher(link)
    link.kv_watchers[b"a"] = 0.0
    assert publisher.publish(sched, 0.0) is not None
    assert publisher.publish(sched, 0.5) is None  # idle pool, heartbeat not due
    link.kv_watchers[b"b"] = 0.5
    assert publisher.publish(sched, 0.6) is not None


def test_frontend_link_tracks_watchers_and_sends_them_snapshots(tmp_path):
    ctx = zmq.Context()
    endpoint = Endpoints.in_directory(str(tmp_path)).request
    link = FrontendLink(ctx, endpoint, structlog.get_logger())
    watcher = ctx.socket(zmq.DEALER)
    watcher.setsockopt(zmq.IDENTITY, b"fe-1")
    watcher.setsockopt(zmq.LINGER, 0)
    watcher.connect(endpoint)
    sched = _scheduler()
    publisher = KvPublisher(link)
    try:
        watcher.send(encode(KvWatch(on=True)))
        assert isinstance(_recv(link), KvWatch) and set(link.kv_watchers) == {b"fe-1"}
        assert publisher.publish(sched, time.monotonic()) is not None
        assert watcher.poll(10_000)
        snapshot = decode(watcher.recv())
        assert isinstance(snapshot, KvSnapshot) and snapshot.snapshot_id == 1
        watcher.send(encode(KvWatch(on=False)))
        _recv(link)
        assert link.kv_watchers == {}
        assert publisher.publish(sched, time.monotonic() + 10) is None
        assert not watcher.poll(200)
    finally:
        watcher.close()
        link.socket.close()
        ctx.term()


def _recv(link: FrontendLink):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        message = link.recv(100)
        if message is not None:
            return message
    raise AssertionError("nothing arrived")


# ---------------------------------------------------------------- the frontend's hub


class _Client:
    """What ``KvHub`` needs of ``EngineClient``."""

    def __init__(self) -> None:
        self.watches: list[bool] = []
        self.on_kv_snapshot = None
        self.latest_stats = None

    def watch_kv(self, on: bool) -> None:
        self.watches.append(on)


def _snapshot(snapshot_id: int) -> KvSnapshot:
    sched = _scheduler()
    return build_kv_snapshot(sched, snapshot_id)


def test_hub_watches_only_while_it_has_clients_and_keeps_only_the_newest_frame():
    async def go():
        client = _Client()
        hub = KvHub(client, renew_s=0.01)
        hub.on_snapshot(_snapshot(1))  # nobody watches: ignored
        assert hub.num_snapshots == 0 and client.watches == []
        slow = hub.subscribe()
        assert client.watches == [True]
        for i in range(2, 12):  # ten snapshots while the client reads none
            hub.on_snapshot(_snapshot(i))
        assert hub.num_dropped == 9 and slow.num_dropped == 9
        frame = await slow.take(1.0)
        assert json.loads(frame[len(b"data: "):])["snapshot_id"] == 11  # the newest, and only it
        assert await slow.take(0.01) is None
        late = hub.subscribe()  # a second client starts from the latest frame at once
        assert json.loads((await late.take(0.01))[len(b"data: "):])["snapshot_id"] == 11
        await asyncio.sleep(0.05)
        assert client.watches.count(True) >= 3  # renewed while watching
        hub.unsubscribe(slow)
        assert False not in client.watches
        hub.unsubscribe(late)
        assert client.watches[-1] is False
        num_watches = len(client.watches)
        await asyncio.sleep(0.05)
        assert len(client.watches) == num_watches  # no renewal once nobody watches
        hub.on_snapshot(_snapshot(12))
        assert hub.num_snapshots == 10

    asyncio.run(go())


def test_closed_mailbox_ends_its_stream():
    async def go():
        box = Mailbox()
        box.offer(b"x")
        box.close()
        assert await box.take(1.0) is None and box.closed

    asyncio.run(go())


@pytest.mark.parametrize("kind", list(KvEventKind))
def test_every_event_kind_has_a_json_name(kind):
    from shared.kv_json import EVENT_NAMES

    assert EVENT_NAMES[kind] in kv_snapshot_schema()["properties"]["events"]["items"]["properties"]["kind"]["enum"]
