"""The KV cache events' ZMQ publisher (``--kv-events-config``), in vLLM's wire format, so that the
routers that read vLLM's events (llm-d's KV cache indexer, NVIDIA Dynamo's KV router) read ours.

Not the playground's publisher (``kv_publisher.py``: block-pool snapshots to our own frontends);
this one takes the prefix cache's events (``kv_cache_events.py``) and sends them to anyone.

Matched against vLLM's ``vllm/distributed/kv_events.py`` at commit
0181ea3173e53eea8cf04a86891488e3dc89bb34 (the config: ``vllm/config/kv_events.py`` at
00634b8acf93e413a1c380288665a543b98be7ea), with the batch as vLLM 0.26 sends it (an array; that
file's ``EventBatch`` lacks ``array_like``, which the consumers do not read: see docs/serving.md):
- frames on the PUB socket: ``(topic, seq as 8 bytes big-endian, payload)``, ``seq`` counting
  batches from 0;
- payload: msgpack of a ``KVEventBatch`` as a positional array ``[ts, events, data_parallel_rank]``,
  each event a map tagged by its ``"type"`` (msgspec ``tag=True`` without ``array_like``):
  ``BlockStored`` (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, group_idx, kv_cache_spec_kind), ``BlockRemoved`` (block_hashes, medium, group_idx),
  ``AllBlocksCleared``;
- replay (``replay_endpoint``, a ROUTER): a client sends a start seq (8 bytes big-endian) and gets
  ``(seq, payload)`` for every buffered batch from it on (the last ``buffer_steps``), then
  ``(-1 as 8 bytes, b"")`` (that commit's layout; a later main puts the topic before ``seq``);
- replica ``i`` of ``-dp N`` tags its batches ``data_parallel_rank = i`` and offsets its ports by ``i``.

msgpack here, never msgspec or pickle. ``publish`` is called once per scheduler loop turn and sends
one batch when there are events; PUB sends never block (past ``hwm`` ZeroMQ drops), so it runs
inline rather than on vLLM's thread and queue; ``serve_replay`` answers waiting replay requests.
"""

from __future__ import annotations

import time
from collections import deque

import msgpack
import zmq

from shared.kv_events_config import KvEventsConfig, offset_endpoint

from .kv_cache_events import Cleared, KvCacheEventLog, Removed, Stored

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def event_map(event, sliding_window: int = 0) -> dict:
    """One event as vLLM's msgspec encodes it (fields without defaults always, the others when set)."""
    if isinstance(event, Stored):
        out = {"type": "BlockStored", "block_hashes": event.block_hashes,
               "parent_block_hash": event.parent_block_hash, "token_ids": event.token_ids,
               "block_size": event.block_size, "lora_id": None, "medium": event.medium, "lora_name": None,
               "group_idx": 0}
        if not sliding_window:
            out["kv_cache_spec_kind"] = "full_attention"
        return out
    if isinstance(event, Removed):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium, "group_idx": 0}
    assert isinstance(event, Cleared), event
    return {"type": "AllBlocksCleared"}


def encode_batch(events: list, ts: float, data_parallel_rank: int, sliding_window: int = 0) -> bytes:
    return msgpack.packb([ts, [event_map(e, sliding_window) for e in events], data_parallel_rank])


class KvEventsPublisher:
    def __init__(self, config: KvEventsConfig, data_parallel_rank: int = 0, ctx: zmq.Context | None = None,
                 log=None) -> None:
        self.config, self.rank, self.log = config, data_parallel_rank, log
        self.ctx = ctx or zmq.Context.instance()
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self.topic = config.topic.encode()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.next_seq = 0
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(config.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay = None
        try:
            if any(s in self.endpoint for s in ("*", "::")) or self.endpoint.startswith(("ipc://", "inproc://")):
                self.pub.bind(self.endpoint)  # vLLM's rule: bind a wildcard or local endpoint, else connect
            else:
                self.pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self.replay = self.ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"--kv-events-config: cannot open {self.endpoint} / {self.replay_endpoint}: {exc}") from None
        if log is not None:
            log.info("kv cache events published", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
                     topic=config.topic, data_parallel_rank=data_parallel_rank)

    def publish(self, events: KvCacheEventLog, sliding_window: int = 0) -> int | None:
        """Send the log's events as one batch, if it holds any; returns the batch's seq."""
        if not events.events:
            return None
        payload = encode_batch(events.drain(), time.time(), self.rank, sliding_window)
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        self.buffer.append((seq, payload))
        return seq

    def serve_replay(self) -> int:
        """Answer the replay requests waiting (never blocks); returns how many."""
        answered = 0
        while self.replay is not None and self.replay.poll(0):
            frames = self.replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                if self.log is not None:
                    self.log.warning("kv events: malformed replay request dropped", num_frames=len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= start_seq:
                    self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self.replay.send_multipart((client, b"", END_SEQ, b""))
            answered += 1
        return answered

    def close(self) -> None:
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(linger=0)
