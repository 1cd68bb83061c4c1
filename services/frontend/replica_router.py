"""Which data-parallel replica takes a request: the one whose prefix cache most likely holds the
prompt's beginning, unless that would load it well beyond the others. A plain class, no I/O.

Each replica is a scheduler with its own executors and its own prefix cache; a prompt prefilled on
one replica is cached only there. The router remembers, per replica, the chained hashes of the
prompt chunks it sent there (``chunk_tokens`` tokens each, hashed like the scheduler's KV blocks:
each chunk's hash covers every token before it), the most recent ``max_chunks_per_replica`` of them.
For a new prompt it counts, per replica, how many of its leading chunks that replica has seen:

- the replica with the longest such match takes it, when its load (requests this frontend has in
  flight there) is at most the lowest load plus ``slack`` (``max(min_slack, lowest * slack_fraction)``);
- otherwise (no chunk seen anywhere, or the best match is too busy) the least loaded replica takes
  it; among equals, the turn passes round (so that an idle server spreads its first requests).

A shared system prompt thus keeps going to the replica that first saw it until that replica runs
ahead by the slack; the next one then caches it too, and from then on both match equally and the
lighter one wins. ``forget`` drops what a replica was sent (its scheduler restarted: its cache is
empty). Only ``available`` replicas are chosen (the caller says which can take work).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from shared.engine_flags import RunnerFlags

CHUNK_TOKENS = RunnerFlags().block_size  # the default KV block size
MAX_CHUNKS_PER_REPLICA = 1 << 16  # 1M prompt tokens' worth of hashes per replica, about 8 MB
MIN_SLACK = 4
SLACK_FRACTION = 0.5


@dataclass(frozen=True)
class Route:
    replica: int
    matched_tokens: int  # leading prompt tokens the chosen replica was sent before (0: none)
    by_prefix: bool  # chosen for its match (else: for its load)


class ReplicaRouter:
    def __init__(self, num_replicas: int, chunk_tokens: int = CHUNK_TOKENS,
                 max_chunks_per_replica: int = MAX_CHUNKS_PER_REPLICA, min_slack: int = MIN_SLACK,
                 slack_fraction: float = SLACK_FRACTION) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if chunk_tokens < 1 or max_chunks_per_replica < 1:
            raise ValueError("chunk_tokens and max_chunks_per_replica must be at least 1")
        self.num_replicas = num_replicas
        self.chunk_tokens = chunk_tokens
        self.max_chunks = max_chunks_per_replica
        self.min_slack = min_slack
        self.slack_fraction = slack_fraction
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._turn = 0

    def chunk_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the prompt's full chunks."""
        ids = np.ascontiguousarray(token_ids, dtype=np.int32)
        hashes: list[int] = []
        size = self.chunk_tokens
        previous = None
        for start in range(0, len(ids) - size + 1, size):
            previous = hash((previous, ids[start:start + size].tobytes()))
            hashes.append(previous)
        return hashes

    def choose(self, token_ids: Sequence[int], loads: Sequence[int], available: Sequence[bool]) -> Route:
        """The replica for a prompt of ``token_ids``, given each replica's ``loads`` and whether it is
        ``available``; records the prompt's chunks as sent there. ``ValueError`` if none is available."""
        if len(loads) != self.num_replicas or len(available) != self.num_replicas:
            raise ValueError(f"expected {self.num_replicas} loads and availabilities")
        candidates = [r for r in range(self.num_replicas) if available[r]]
        if not candidates:
            raise ValueError("no replica is available")
        hashes = self.chunk_hashes(token_ids)
        lowest = min(loads[r] for r in candidates)
        matched = {r: self._matched(r, hashes) for r in candidates}
        best = max(candidates, key=lambda r: (matched[r], -loads[r]))
        slack = max(self.min_slack, int(lowest * self.slack_fraction))
        if matched[best] > 0 and loads[best] <= lowest + slack:
            route = Route(best, matched[best] * self.chunk_tokens, True)
        else:
            least = [r for r in candidates if loads[r] == lowest]
            choice = min(least, key=lambda r: (r - self._turn) % self.num_replicas)
            self._turn = (choice + 1) % self.num_replicas
            route = Route(choice, matched[choice] * self.chunk_tokens, False)
        self._record(route.replica, hashes)
        return route

    def forget(self, replica: int) -> None:
        """``replica``'s cache is gone (its scheduler restarted)."""
        self._seen[replica].clear()

    def num_chunks(self, replica: int) -> int:
        return len(self._seen[replica])

    def _matched(self, replica: int, hashes: list[int]) -> int:
        seen = self._seen[replica]
        num = 0
        for h in hashes:
            if h not in seen:
                break
            num += 1
        return num

    def _record(self, replica: int, hashes: list[int]) -> None:
        seen = self._seen[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_chunks:
            seen.popitem(last=False)
