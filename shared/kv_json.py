"""The JSON form of a ``KvSnapshot``: what ``/v1/kv/events`` streams and ``simulate --html`` embeds,
and its JSON Schema (served in ``/openapi.json``). One declaration of the shape, used by both.

Block ``i`` of the device pool is ``blocks.ref_counts[i]`` (0: not in any table) and
``blocks.cached[i]`` (1: holds a prefix-cache entry; with count 0 it is cached but free, reusable
by a later prompt, evicted when a block is needed). Its owners are the sequences whose
``block_table`` holds ``i`` (``on_cpu`` tables index the CPU pool instead).
"""

from __future__ import annotations

import dataclasses
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
        "blocks": {"ref_counts": snapshot.ref_counts.tolist(), "cached": snapshot.cached.astype(int).tolist()},
        "cpu_blocks": {"ref_counts": snapshot.cpu_ref_counts.tolist()},
        "sequences": sequences,
        "events": events,
        "num_events_dropped": snapshot.num_events_dropped,
        "stats": dataclasses.asdict(snapshot.stats),
    }


def _ints(description: str, maximum: int | None = None) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "integer", "minimum": 0}
    if maximum is not None:
        item["maximum"] = maximum
    return {"type": "array", "items": item, "description": description}


def kv_snapshot_schema() -> dict[str, Any]:
    """JSON Schema of ``kv_snapshot_json``'s output."""
    stats = {f.name: {"type": "boolean" if f.type in (bool, "bool") else "integer"}
             for f in dataclasses.fields(EngineStats)}
    sequence = {"type": "object", "required": ["seq_id", "request_id", "choice", "on_cpu", "num_tokens", "block_table"],
                "properties": {
                    "seq_id": {"type": "integer"},
                    "request_id": {"type": "string", "description": "the id of the request's response"},
                    "choice": {"type": "integer", "description": "its choice (index) within the request"},
                    "on_cpu": {"type": "boolean", "description": "swapped out: block_table indexes cpu_blocks"},
                    "num_tokens": {"type": "integer", "description": "tokens held in its blocks"},
                    "block_table": _ints("logical block i -> physical block id")}}
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
            "blocks": {"type": "object", "required": ["ref_counts", "cached"], "properties": {
                "ref_counts": _ints("device block id -> block tables holding it"),
                "cached": _ints("device block id -> 1 if it holds a prefix-cache entry", 1)}},
            "cpu_blocks": {"type": "object", "required": ["ref_counts"], "properties": {
                "ref_counts": _ints("CPU (swap) block id -> block tables holding it")}},
            "sequences": {"type": "array", "items": sequence},
            "events": {"type": "array", "items": event, "description": "block moves since the previous snapshot"},
            "num_events_dropped": {"type": "integer", "description": "moves that did not fit the scheduler's log"},
            "stats": {"type": "object", "properties": stats, "description": "the engine's counters (EngineStats)"},
        },
    }
