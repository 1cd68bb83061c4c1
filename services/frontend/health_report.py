"""/health: whether the server can answer now, and how each of its processes is.

200 only when the scheduler has been heard from within its heartbeat timeout, its latest stats
say ready, and every executor rank is ``ok`` (answering its heartbeats); else 503 with the reason.
The body reports each process (this frontend: pid, uptime, restarts; the scheduler: epoch, pid,
seconds since its last stats, restarts; every executor rank: status, pid, seconds since its
heartbeat, restarts) and the executor group (tensor-parallel size, all-reduce kind, KV blocks and
bytes per rank) beside the engine's counters. The restarts are the counts /metrics reports
(``restarts``, the caller's ``process_restarts``: the launcher's under ``pagedserve serve``, else
those the processes saw; see ``metrics``); the executor ranks restart together, so each rank reports
the group's count.

With data-parallel replicas (``replicas.Replicas``) the body sums their counters and lists each
replica's own report under ``replicas`` (its scheduler and executors, their restarts as that
replica's processes saw them). It is 200 once every replica has been ready and while at least one
is: a replica being mended takes no new requests and the others serve (``degraded`` says which
and why); 503 while any replica is still starting or when none is ready.
"""

from __future__ import annotations

import os
import time
from typing import Any

from services.frontend.engine_client import EngineClient
from services.frontend.replicas import Replicas


def health_report(client: EngineClient | Replicas, restarts: dict[str, int]) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body). ``restarts``: restarts by process ("executor", "scheduler", "frontend"),
    as /metrics reports them."""
    if isinstance(client, Replicas):
        return _replicas_report(client, restarts)
    stats = client.latest_stats
    if stats is None:
        return 503, {"status": "unavailable", "reason": "no stats from the scheduler yet",
                     "processes": {"frontend": _frontend(restarts)}}
    silence = client.scheduler_silence_s() or 0.0
    lost = [e for e in stats.executors if e.status != "ok"]
    reason = None
    if client.scheduler_lost:
        reason = f"the scheduler has not answered for {silence:.1f} s"
    elif lost:
        reason = "executor " + ", ".join(f"rank {e.rank} is {e.status}" for e in lost)
    elif not stats.ready:
        reason = "the scheduler is not ready"
    body: dict[str, Any] = {"status": "ok" if reason is None else "unavailable"}
    if reason is not None:
        body["reason"] = reason
    body["seconds_since_stats"] = round(silence, 3)
    body.update(_counters(stats))
    body.update({
        "group": _group(stats),
        "processes": {
            "frontend": _frontend(restarts),
            "scheduler": {"status": "lost" if client.scheduler_lost else "ok", "pid": stats.pid,
                          "epoch": stats.epoch, "seconds_since_stats": round(silence, 3),
                          "num_restarts": restarts["scheduler"]},
            "executors": [{"rank": e.rank, "status": e.status, "pid": e.pid,
                           "seconds_since_heartbeat": e.seconds_since_heartbeat,
                           "num_restarts": restarts["executor"]}
                          for e in stats.executors],
        },
    })
    return (200 if reason is None else 503), body


def _replicas_report(replicas: Replicas, restarts: dict[str, int]) -> tuple[int, dict[str, Any]]:
    reports = [health_report(c, c.process_restarts()) for c in replicas.clients]
    ever_ready = replicas.ever_ready()
    down = [f"replica {i}: {body.get('reason', 'unavailable')}" for i, (code, body) in enumerate(reports)
            if code != 200]
    starting = [i for i, ready in enumerate(ever_ready) if not ready]
    serving = any(code == 200 for code, _ in reports) and not starting
    body: dict[str, Any] = {"status": "ok" if serving else "unavailable"}
    if down:
        body["reason" if not serving else "degraded"] = "; ".join(down)
    body["data_parallel_size"] = len(replicas)
    stats = replicas.latest_stats
    if stats is not None:
        body.update(_counters(stats))
    body["processes"] = {"frontend": _frontend(restarts)}
    body["replicas"] = []
    for i, (_, report) in enumerate(reports):
        report.get("processes", {}).pop("frontend", None)
        body["replicas"].append({"replica": i, **report})
    return (200 if serving else 503), body


def _counters(stats) -> dict[str, Any]:
    """The engine's counters, for /health."""
    return {
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_blocks_total": stats.num_blocks_total,
        "num_blocks_used": stats.num_blocks_used,
        "num_preemptions": stats.num_preemptions,
        "num_preemptions_by_mode": {"swap": stats.num_swap_outs, "recompute": stats.num_recomputes},
        "num_cached_blocks": stats.num_cached_blocks,
        "num_swapped": stats.num_swapped,
        "max_num_running": stats.max_num_running,
        # this moment: tokens the running sequences hold, and the slots of every block table
        "num_slots_used": stats.num_slots_used,
        "num_slots_allocated": stats.num_slots_allocated,
        # mean over all steps so far of slots holding tokens / slots allocated
        "kv_slot_utilization": stats.sum_slots_used / stats.sum_slots_allocated if stats.sum_slots_allocated else None,
    }


def _group(stats) -> dict[str, Any]:
    """The executor group: tensor-parallel size, all-reduce kind, KV blocks and bytes per rank."""
    return {"world_size": stats.world_size, "all_reduce": stats.all_reduce,
            "num_kv_blocks_per_rank": stats.num_kv_blocks_per_rank,
            "kv_cache_bytes_per_rank": stats.kv_cache_bytes_per_rank,
            "kv_cache_dtype": stats.kv_cache_dtype,
            "num_kv_tokens_per_rank": [n * stats.kv_block_size for n in stats.num_kv_blocks_per_rank]}


_STARTED = time.monotonic()


def _frontend(restarts: dict[str, int]) -> dict[str, Any]:
    """This frontend; ``num_restarts`` counts the frontends replaced before it (the launcher's
    count), or those the scheduler lost where no launcher supervises them, as /metrics does."""
    return {"status": "ok", "pid": os.getpid(), "uptime_s": round(time.monotonic() - _STARTED, 1),
            "num_restarts": restarts.get("frontend", 0)}
