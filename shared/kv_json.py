"""The JSON form of a ``KvSnapshot``: what ``/v1/kv/events`` streams and ``simulate --html`` embeds,
and its JSON Schema (served in ``/openapi.json``). One declaration of the shape, used by both.

Sparse: a pool lists the blocks some table holds (``used_block_ids``, with their ``ref_counts``)
and, on the device, the blocks with a prefix-cache entry (``cached_block_ids``; one that is not
also used is cached but free: reusable by a later prompt with the same prefix, evicted when a block
is needed). Every other block is free. A block's owners are the sequences whose ``block_table``
holds it (``on_cpu`` tables index the CPU pool instead).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from shared.messages import EngineStats, KvEventKind, KvSnapshot

EVENT_NAMES = {kind: kind.name.lower() for kind in KvEventKind}  # KvEventKind.SWAP_OUT -> "swap_out"


def kv_snapshot_json(snapshot: KvSnapshot) -> dict[str, Any]:
    """The snapshot as plain JSON values (lists of ints, no arrays)."""
    starts = snapshot.table_starts.tolist()
    block_ids = snapshot.table_block_ids.tolist()
    sequences = [
        {"seq_id": seq_id, "request_id": request_id, "choice": choice, "on_cpu": on_cpu, "num_tokens": num_tokens,
         "block_table": block_ids[starts[i]:starts[i + 1]]}
        for i, (seq_id, request_id, choice, on_cpu, num_tokens) in enumerate(zip(
            snapshot.seq_ids.tolist(), snapshot.request_ids, snapshot.choice_idxs.tolist(),
            snapshot.on_cpu.tolist(), snapshot.num_computed_tokens.tolist()))
    ]
    events = [{"kind": EVENT_NAMES[KvEventKind(kind)], "src": src, "dst": dst if dst >= 0 else None}
              for kind, src, dst in snapshot.events.tolist()]
    return {
        "snapshot_id": snapshot.snapshot_id,
        "block_size": snapshot.block_size,
        "blocks": {"num_blocks": snapshot.num_blocks, "used_block_ids": snapshot.used_block_ids.tolist(),
                   "ref_counts": snapshot.used_ref_counts.tolist(),
                   "cached_block_ids": snapshot.cached_block_ids.tolist()},
        "cpu_blocks": {"num_blocks": snapshot.num_cpu_blocks, "used_block_ids": snapshot.cpu_used_block_ids.tolist(),
                       "ref_counts": snapshot.cpu_used_ref_counts.tolist()},
        "sequences": sequences,
        "events": events,
        "num_events_dropped": snapshot.num_events_dropped,
        "stats": dataclasses.asdict(snapshot.stats),
    }


def _ints(description: str) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer", "minimum": 0}, "description": description}


def _pool(description: str, cached: bool = False) -> dict[str, Any]:
    properties = {
        "num_blocks": {"type": "integer", "minimum": 0},
        "used_block_ids": _ints("blocks some block table holds, ascending (every other block has count 0)"),
        "ref_counts": _ints("the block tables holding each of used_block_ids"),
    }
    if cached:
        properties["cached_block_ids"] = _ints("blocks holding a prefix-cache entry (not used: cached but free)")
    return {"type": "object", "description": description, "required": list(properties), "properties": properties}


_SCALARS = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _json_schema_of(hint: Any) -> dict[str, Any]:
    """The JSON Schema of a message field's type (scalars, lists, optionals, nested dataclasses)."""
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return {"type": "array", "items": _json_schema_of(args[0])}
    if origin in (typing.Union, types.UnionType):
        options = [_json_schema_of(a) for a in args if a is not type(None)]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {"anyOf": [schema, {"type": "null"}]} if type(None) in args else schema
    if dataclasses.is_dataclass(hint):
        nested = typing.get_type_hints(hint)
        return {"type": "object", "properties": {f.name: _json_schema_of(nested[f.name])
                                                 for f in dataclasses.fields(hint)}}
    raise TypeError(f"no JSON schema for {hint!r}")


def kv_snapshot_schema() -> dict[str, Any]:
    """JSON Schema of ``kv_snapshot_json``'s output."""
    hints = typing.get_type_hints(EngineStats)
    stats = {f.name: _json_schema_of(hints[f.name]) for f in dataclasses.fields(EngineStats)}
    sequence = {"type": "object", "required": ["seq_id", "request_id", "choice", "on_cpu", "num_tokens", "block_table"],
                "properties": {
                    "seq_id": {"type": "integer"},
                    "request_id": {"type": "string", "description": "the id of the request's response"},
                    "choice": {"type": "integer", "description": "its choice (index) within the request"},
                    "on_cpu": {"type": "boolean", "description": "swapped out: block_table indexes cpu_blocks"},
                    "num_tokens": {"type": "integer", "description": "tokens held in its blocks"},
                    "block_table": {**_ints("logical block i -> physical block id; -1: freed out of the sliding window"),
                                    "items": {"type": "integer", "minimum": -1}}}}
    event = {"type": "object", "required": ["kind", "src", "dst"], "properties": {
        "kind": {"enum": list(EVENT_NAMES.values()), "description": "copy: copy-on-write, device src to device "
                 "dst; evict: cached device block src reused; swap_out: device src to CPU dst; swap_in: CPU src "
                 "to device dst"},
        "src": {"type": "integer"}, "dst": {"type": ["integer", "null"]}}}
    return {
        "type": "object",
        "description": "The KV block pool at one moment (one server-sent event's data).",
        "required": ["snapshot_id", "block_size", "blocks", "cpu_blocks", "sequences", "events",
                     "num_events_dropped", "stats"],
        "properties": {
            "snapshot_id": {"type": "integer"},
            "block_size": {"type": "integer", "description": "token slots per block"},
            "blocks": _pool("The device pool.", cached=True),
            "cpu_blocks": _pool("The CPU pool that swapped-out sequences' blocks move to."),
            "sequences": {"type": "array", "items": sequence},
            "events": {"type": "array", "items": event, "description": "block moves since the previous snapshot"},
            "num_events_dropped": {"type": "integer", "description": "moves that did not fit the scheduler's log"},
            "stats": {"type": "object", "properties": stats, "description": "the engine's counters (EngineStats)"},
        },
    }
