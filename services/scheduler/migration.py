"""Live migration of a request between data-parallel replicas: what moves, and the steps one
migration goes through. Plain Python, no I/O (``migration_desk`` applies it to a scheduler; the
offline ``ReplicatedEngine`` or the frontend drive it).

A migration of request R from replica A to replica B:

1. ``PRECOPY``: A's executors write R's full blocks to files (``Step.migrate_ops``) while R keeps
   decoding on A.
2. ``PAUSED``: R leaves A's batch (between steps: no step in flight computes for it); the blocks
   filled since, and the last, partial one, are written in one more step.
3. ``SEALED``: that step is done; ``MigratedSequence`` (tokens so far, sampling, progress, one
   file key per block) can go to B.
4. ``IMPORTING``: B took blocks for R and reads the files into them in its next step; R joins B's
   batch once they are in (``num_computed_tokens`` as on A: nothing is computed again).
5. ``DONE``: B has R; A forgets it, sending nothing. Or ``ABORTED`` from any step before: B refused
   (no room, a failed read) or died, or A's write failed: R goes on at A, where it never stopped
   being (its blocks stay held at A until ``DONE``). Nothing is lost and nothing runs twice.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from enum import StrEnum

from shared.messages import AddRequest


class Phase(StrEnum):
    PRECOPY = "precopy"
    PAUSED = "paused"
    SEALED = "sealed"
    IMPORTING = "importing"
    DONE = "done"
    ABORTED = "aborted"


NEXT = {
    Phase.PRECOPY: {Phase.PAUSED, Phase.ABORTED},
    Phase.PAUSED: {Phase.SEALED, Phase.ABORTED},
    Phase.SEALED: {Phase.IMPORTING, Phase.ABORTED},
    Phase.IMPORTING: {Phase.DONE, Phase.ABORTED},
    Phase.DONE: set(),
    Phase.ABORTED: set(),
}


class MigrationError(ValueError):
    """A migration that cannot start (unknown request, unsupported kind) or a step out of order."""


@dataclass
class Migration:
    """One migration's progress: ``to`` moves it on, refusing a step out of order."""

    migration_id: str
    request_id: str
    source: int
    target: int
    phase: Phase = Phase.PRECOPY
    reason: str = ""  # why it was aborted
    history: list[Phase] = field(default_factory=lambda: [Phase.PRECOPY])

    @property
    def finished(self) -> bool:
        return self.phase in (Phase.DONE, Phase.ABORTED)

    def to(self, phase: Phase, reason: str = "") -> None:
        if phase not in NEXT[self.phase]:
            raise MigrationError(f"migration {self.migration_id}: {self.phase} cannot go to {phase}")
        self.phase, self.reason = phase, reason
        self.history.append(phase)


@dataclass
class MigratedSequence:
    """What moves from A to B besides the blocks' bytes: ``request`` as B admits it (its outputs
    so far as ``resumed_token_ids``, counted as sent), how many tokens the blocks hold, and the key
    of each block's file, in table order."""

    migration_id: str
    request: AddRequest
    num_computed_tokens: int
    num_cached_tokens: int
    cum_logprob: float
    keys: list[bytes]


def block_key(migration_id: str, index: int) -> bytes:
    """The 16-byte file key of block ``index`` of a migration (unique across migrations)."""
    return hashlib.blake2b(f"{migration_id}:{index}".encode(), digest_size=16).digest()


def refusal_to_move(group, seq, blocks) -> str | None:
    """Why a request's group cannot migrate (None: it can). n > 1, best_of and beam search groups
    share blocks between their sequences and are refused, as are guided requests (the grammar's
    state lives in the executor), prompt scoring and pooling (their partial sums too)."""
    from .groups import SequenceGroup

    if type(group) is not SequenceGroup or len(group.seqs) != 1:
        return "requests with n > 1, best_of or beam search are not migrated"
    if seq.sampling.guided is not None:
        return "guided (structured output) requests are not migrated: their grammar state is the executor's"
    if seq.prompt_scores is not None or seq.pooling is not None:
        return "requests with prompt_logprobs or pooling are not migrated"
    if blocks.sliding_window:
        return "models with a sliding window are not migrated (their tables have freed blocks)"
    if seq.finish_reason is not None:
        return "the request has finished"
    if seq.status.value == "swapped":
        return "the request is swapped out; try again once it runs"
    return None


def request_of(seq) -> AddRequest:
    """The ``AddRequest`` the target admits: the prompt, and the outputs so far as resumed (sent)."""
    import numpy as np

    return AddRequest(seq.request_id, np.asarray(seq.prompt_token_ids, np.int32), seq.sampling, seq.arrival_time,
                      resumed_token_ids=np.asarray(seq.output_token_ids, np.int32))
