"""The block manager's log of block moves (copy-on-write copies, evictions, swaps), for the
playground's map. Plain Python, no I/O.

Contract: ``record`` does nothing while the log is disabled (nobody watches the pool: the default),
so the block manager pays one attribute test per move. Enabled, it keeps at most ``max_events``
moves, oldest dropped first and counted; ``drain`` hands them over and empties the log.
Disabling empties it too, so a later watcher never sees moves from before it came.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

import numpy as np

from shared.messages import KvEventKind

MAX_EVENTS = 4096


class KvEventLog:
    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        if max_events <= 0:
            raise ValueError(f"max_events must be positive, got {max_events}")
        self.enabled = False
        self._events: deque[tuple[int, int, int]] = deque(maxlen=max_events)
        self.num_dropped = 0  # since the last drain

    def record(self, kind: KvEventKind, src: int, dst: int = -1) -> None:
        """Note one move of block ``src`` (to ``dst``); a no-op while disabled."""
        if not self.enabled:
            return
        if len(self._events) == self._events.maxlen:
            self.num_dropped += 1
        self._events.append((int(kind), src, dst))

    def record_pairs(self, kind: KvEventKind, pairs: Iterable[tuple[int, int]]) -> None:
        if self.enabled:
            for src, dst in pairs:
                self.record(kind, src, dst)

    def set_enabled(self, enabled: bool) -> None:
        if not enabled:
            self._events.clear()
            self.num_dropped = 0
        self.enabled = enabled

    def drain(self) -> tuple[np.ndarray, int]:
        """``([E, 3] int32 (kind, src, dst) rows oldest first, moves dropped)``; empties the log."""
        rows = np.array(self._events, dtype=np.int32).reshape(-1, 3)
        num_dropped = self.num_dropped
        self._events.clear()
        self.num_dropped = 0
        return rows, num_dropped
