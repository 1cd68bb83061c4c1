"""vLLM's KV cache event schema as msgspec Structs, the reference our publisher's bytes are decoded
with, and a consumer's view of a stream of them (what an external router would hold).

The event Structs declare, field for field (names, types, order, defaults, msgspec options), those
of vllm-project/vllm ``vllm/distributed/kv_events.py`` at commit
0181ea3173e53eea8cf04a86891488e3dc89bb34 (msgspec ``tag=True`` without ``array_like``: each event a
map tagged by its ``"type"``, as vLLM sends them since vllm-project/vllm#42892). The batch is the
positional array vLLM 0.26 sends (``[ts, events, data_parallel_rank]``: ``array_like=True``, as in
vLLM's own subscriber example ``examples/features/kv_events``, and as NVIDIA Dynamo's
``KvEventBatch`` and llm-d's ``msgpackVLLMEventBatch`` declare it); that commit's file declares the
base ``EventBatch`` without ``array_like`` (a map), which those consumers do not read: see
docs/serving.md.
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = bytes | int  # vllm.v1.core.kv_cache_utils.ExternalBlockHash


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Every event: a msgpack map whose "type" names its class."""


MEDIUM_GPU = "GPU"


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int

    lora_id: int | None
    medium: str | None
    lora_name: str | None

    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload as vLLM's subscribers decode it (``msgspec.ValidationError`` if it is not one)."""
    return DECODER.decode(payload)


def apply(held: set[int], events) -> set[int]:
    """A router's view: the block hashes ``held`` after ``events`` (vLLM's Structs, or the block
    manager's own ``Stored``/``Removed``/``Cleared``, which carry the same field names)."""
    for event in events:
        kind = type(event).__name__
        if kind in ("BlockStored", "Stored"):
            held.update(event.block_hashes)
        elif kind in ("BlockRemoved", "Removed"):
            held.difference_update(event.block_hashes)
        elif kind in ("AllBlocksCleared", "Cleared"):
            held.clear()
        else:
            raise AssertionError(f"unknown event {event!r}")
    return held
