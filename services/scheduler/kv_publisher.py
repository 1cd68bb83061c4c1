"""When the scheduler builds a block-pool snapshot, and for whom: the playground's data source.

Frontends ask with ``KvWatch(on=True)`` while they have clients on ``/v1/kv/events`` and renew it
about once a second; ``FrontendLink`` keeps each watcher's last renewal. ``KvPublisher.publish``,
called once per scheduler loop, costs one dictionary test while nobody watches: no snapshot is
built and the block manager's event log is disabled. While someone watches it builds at most one
snapshot per ``min_interval_s`` (4 a second), only when the pool may have changed (or a new
watcher came, or ``heartbeat_s`` passed), and sends it to every watcher without blocking (a busy
frontend misses that one; the next follows). A watch not renewed for ``lapse_s`` ends.
"""

from __future__ import annotations

from typing import Protocol

from shared.messages import KvSnapshot, encode

from .kv_snapshot import build_kv_snapshot
from .scheduler import Scheduler

MIN_INTERVAL_S = 0.25
HEARTBEAT_S = 2.0
WATCH_LAPSE_S = 5.0


class WatchLink(Protocol):
    kv_watchers: dict[bytes, float]  # frontend identity -> time of its last KvWatch(on=True)

    def send_kv_snapshot(self, frame: bytes) -> None: ...


class KvPublisher:
    def __init__(self, link: WatchLink, min_interval_s: float = MIN_INTERVAL_S, heartbeat_s: float = HEARTBEAT_S,
                 lapse_s: float = WATCH_LAPSE_S) -> None:
        self.link = link
        self.min_interval_s = min_interval_s
        self.heartbeat_s = heartbeat_s
        self.lapse_s = lapse_s
        self.num_built = 0
        self._last_time = float("-inf")
        self._last_version: tuple | None = None
        self._sent_to: set[bytes] = set()

    def publish(self, sched: Scheduler, now: float) -> KvSnapshot | None:
        """Build and send a snapshot if one is due; returns it (None when none was built)."""
        watchers = self.link.kv_watchers
        for identity in [i for i, renewed in watchers.items() if now - renewed > self.lapse_s]:
            del watchers[identity]
        events = sched.blocks.events
        if not watchers:
            if events.enabled:
                events.set_enabled(False)
                self._sent_to = set()
            return None
        if not events.enabled:
            events.set_enabled(True)
        if now - self._last_time < self.min_interval_s:
            return None
        version = _version(sched)
        newcomer = not watchers.keys() <= self._sent_to
        if version == self._last_version and not newcomer and now - self._last_time < self.heartbeat_s:
            return None
        self.num_built += 1
        sched.stats.num_kv_snapshots = self.num_built
        snapshot = build_kv_snapshot(sched, self.num_built)
        self.link.send_kv_snapshot(encode(snapshot))
        self._last_time, self._last_version, self._sent_to = now, version, set(watchers)
        return snapshot


def _version(sched: Scheduler) -> tuple:
    """Changes whenever the pool may have: a step ran, a request came or went, a block moved."""
    blocks = sched.blocks
    return (sched.stats.num_steps, sched.num_unfinished_requests, len(sched.waiting), len(sched.swapped),
            blocks.num_used_blocks, blocks.num_cached_blocks, len(blocks.cpu_free_queue))
