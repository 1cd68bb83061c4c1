"""One scheduler's side of live migrations (``migration``), both ways. Plain Python, no I/O: the
bytes move by the executors (``Step.migrate_ops``), the process or the offline engine passes
``MigratedSequence`` between replicas and calls, around each ``Scheduler.schedule``/``update``:
``take_ops`` before, ``attach`` after (a step of only moves when nothing else runs), ``update``
with every result.

Outgoing (A): ``begin_out`` checks the request can move; each step writes its blocks that are full
and not written yet (pre-copy); ``pause`` takes it out of the batch once no step in flight computes
for it and writes the rest; ``sealed`` then gives its ``MigratedSequence``; ``commit_out`` forgets
it (B has it) or ``abort_out`` puts it back in the batch. Its blocks stay held until then.

Incoming (B): ``begin_in`` takes blocks for the tokens the files hold (or refuses: no room, a
request id in use) and reads them in the next step; ``incoming_status`` says ``accepted`` once they
are in (the sequence joins the batch as it was on A) or ``refused``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .admission import refusal
from .groups import new_group
from .migration import MigratedSequence, MigrationError, block_key, refusal_to_move, request_of
from .sequence import Sequence, SequenceStatus
from .step_builder import build_step

EXPORT, IMPORT, DELETE = 1, 2, 3  # services/executor/kv_migration.py


@dataclass
class _Out:
    migration_id: str
    seq: Sequence
    written: int = 0  # leading blocks whose export has been sent
    paused: bool = False
    want_pause: bool = False
    pending: set = field(default_factory=set)  # keys sent, not yet answered
    failed: bool = False


@dataclass
class _In:
    state: MigratedSequence
    seq: Sequence
    pending: set = field(default_factory=set)
    status: str = "importing"  # then accepted, or refused: why


class MigrationDesk:
    def __init__(self, scheduler, directory: str = "") -> None:
        self.s = scheduler
        self.directory = directory  # shared by the replicas; "" refuses every migration
        self.outgoing: dict[str, _Out] = {}
        self.incoming: dict[str, _In] = {}
        self._ops: list[tuple[int, int, bytes]] = []
        self._steps: dict[int, list[bytes]] = {}  # step id -> keys it moves
        self.prefetched: dict[str, _In] = {}  # pre-copied blocks read before the state comes

    # ------------------------------------------------------------------ outgoing

    def begin_out(self, request_id: str, migration_id: str) -> None:
        """Start moving ``request_id`` out; ``MigrationError`` says why it cannot."""
        group = self.s.groups.get(request_id)
        if group is None:
            raise MigrationError(f"unknown request {request_id}")
        if not self.directory:
            raise MigrationError("this engine has no migration directory")
        if request_id in self.outgoing or request_id in self.incoming:
            raise MigrationError(f"request {request_id} is already migrating")
        reason = refusal_to_move(group, group.seqs[0], self.s.blocks)
        if reason is not None:
            raise MigrationError(reason)
        self.outgoing[request_id] = _Out(migration_id, group.seqs[0])

    def take_ops(self) -> None:
        """Before ``schedule``: export the blocks full of computed tokens (pre-copy)."""
        for out in self.outgoing.values():
            if not out.paused and out.seq.status is SequenceStatus.RUNNING:
                self._export(out, out.seq.num_computed_tokens // self.s.blocks.block_size)

    def _export(self, out: _Out, upto: int) -> None:
        table = self.s.blocks.block_tables.get(out.seq.seq_id, [])
        for i in range(out.written, min(upto, len(table))):
            key = block_key(out.migration_id, i)
            self._ops.append((EXPORT, table[i], key))
            out.pending.add(key)
        out.written = max(out.written, min(upto, len(table)))

    def pause(self, request_id: str) -> bool:
        """Take the request out of the batch and write its last blocks; False: not now (a step in
        flight computes for it; try after the next result)."""
        out = self.outgoing[request_id]
        seq = out.seq
        if out.paused:
            return True
        if self.s._in_flight.schedules(seq.seq_id) or seq in getattr(self.s, "parked", ()):
            out.want_pause = True  # the engine stops planning ahead (``wants_pause``)
            return False  # a step computes for it, or its prefix loads from disk (``tiered``)
        if seq.status is SequenceStatus.RUNNING:
            self.s.running.remove(seq)
            self._export(out, self.s.blocks.blocks_needed(seq.num_computed_tokens))
        elif seq in self.s.waiting:
            self.s.waiting.remove(seq)
        seq.status = SequenceStatus.WAITING  # in no queue: the scheduler leaves it alone
        out.paused = True
        return True

    @property
    def wants_pause(self) -> bool:
        """A request waits to pause: apply each result before planning the next step (async scheduling)."""
        return any(out.want_pause and not out.paused for out in self.outgoing.values())

    def sealed(self, request_id: str) -> MigratedSequence | None:
        """The request's state once paused and every block is written (None: not yet)."""
        out = self.outgoing[request_id]
        if not out.paused or out.pending or out.failed:
            return None
        seq = out.seq
        request = request_of(seq)
        return MigratedSequence(out.migration_id, request, seq.num_computed_tokens, seq.num_cached_tokens,
                                seq.cum_logprob, [block_key(out.migration_id, i) for i in range(out.written)])

    def written_keys(self, request_id: str) -> list[bytes] | None:
        """The keys of the blocks pre-copied so far, once every write is answered (None: not yet)."""
        out = self.outgoing[request_id]
        if out.pending or out.failed:
            return None
        return [block_key(out.migration_id, i) for i in range(out.written)]

    def outgoing_failed(self, request_id: str) -> bool:
        out = self.outgoing[request_id]
        return out.failed or request_id not in self.s.groups

    def commit_out(self, request_id: str) -> None:
        """B has the request: forget it here, sending nothing, and free its blocks."""
        out = self.outgoing.pop(request_id)
        group = self.s.groups.get(request_id)
        if group is not None:
            self.s._apply(group, group.abort())

    def abort_out(self, request_id: str) -> None:
        """The migration failed: the request goes on here (its files are deleted)."""
        out = self.outgoing.pop(request_id)
        for i in range(out.written):
            self._ops.append((DELETE, 0, block_key(out.migration_id, i)))
        seq = out.seq
        if not out.paused or request_id not in self.s.groups:
            return
        if seq.num_computed_tokens and seq.seq_id in self.s.blocks.block_tables:
            seq.status = SequenceStatus.RUNNING
            self.s._insert_running(seq)
        else:
            self.s.waiting.appendleft(seq)

    # ------------------------------------------------------------------ incoming

    def begin_in(self, state: MigratedSequence) -> None:
        """Take blocks for ``state`` and read its files next step; ``MigrationError``: refused."""
        request = state.request
        reason = refusal(request, self.s.config, self.s.blocks)
        if reason is None and (request.request_id in self.s.groups or request.request_id in self.incoming):
            reason = f"request id {request.request_id} is already in use"
        if reason is not None:
            raise MigrationError(reason)
        blocks = self.s.blocks
        pre = self.prefetched.get(request.request_id)
        needed = blocks.blocks_needed(state.num_computed_tokens)
        if pre is not None:
            needed -= len(blocks.block_tables.get(pre.seq.seq_id, ()))
        if needed + blocks.watermark_blocks > blocks.num_free_blocks:
            self.drop_prefetch(request.request_id)
            raise MigrationError(f"no room: the sequence needs {needed} KV blocks, {blocks.num_free_blocks} are free")
        group = new_group(request, self.s.config.max_model_len, self.s._seq_ids)
        seq = group.seqs[0]
        seq.num_cached_tokens, seq.cum_logprob = state.num_cached_tokens, state.cum_logprob
        self.s.groups[request.request_id] = group
        entry = self.incoming[request.request_id] = _In(state, seq)
        if state.num_computed_tokens == 0:  # waiting at A: it simply waits here
            self.s.waiting.append(seq)
            entry.status = "accepted"
            return
        ready = self._take_prefetch(request.request_id, seq, entry)
        assert blocks.allocate_slots(seq.seq_id, state.num_computed_tokens)
        seq.num_computed_tokens = state.num_computed_tokens
        for block_id, key in list(zip(blocks.block_tables[seq.seq_id], state.keys))[ready:]:
            self._ops.append((IMPORT, block_id, key))
            entry.pending.add(key)
        if not entry.pending:
            self._accept(request.request_id, entry)

    def prefetch_in(self, request_id: str, keys: list[bytes]) -> bool:
        """During pre-copy: take blocks for the files written so far and read them now, so that the
        pause reads only the last ones; False (nothing done) without room or when already asked."""
        blocks = self.s.blocks
        if (request_id in self.prefetched or request_id in self.s.groups or not keys
                or len(keys) + blocks.watermark_blocks > blocks.num_free_blocks):
            return False
        holder = Sequence(next(self.s._seq_ids), request_id, 0, [], None, frozenset(), 0.0)
        assert blocks.allocate_slots(holder.seq_id, len(keys) * blocks.block_size)
        entry = self.prefetched[request_id] = _In(None, holder)
        for block_id, key in zip(blocks.block_tables[holder.seq_id], keys):
            self._ops.append((IMPORT, block_id, key))
            entry.pending.add(key)
        return True

    def drop_prefetch(self, request_id: str) -> None:
        """The migration ended without ``begin_in``: free what was read ahead."""
        entry = self.prefetched.pop(request_id, None)
        if entry is not None:
            self.s.blocks.free(entry.seq.seq_id)

    def _take_prefetch(self, request_id: str, seq: Sequence, entry: _In) -> int:
        """Give ``seq`` the blocks read ahead for it; returns how many (0: none, or a read failed)."""
        pre = self.prefetched.pop(request_id, None)
        if pre is None or pre.status != "importing":
            if pre is not None:
                self.s.blocks.free(pre.seq.seq_id)
            return 0
        self.s.blocks.block_tables[seq.seq_id] = self.s.blocks.block_tables.pop(pre.seq.seq_id)
        entry.pending |= pre.pending
        return len(self.s.blocks.block_tables[seq.seq_id])

    def incoming_status(self, request_id: str, forget: bool = False) -> str:
        return (self.incoming.pop if forget else self.incoming.__getitem__)(request_id).status

    # ------------------------------------------------------------------ steps

    def attach(self, step):
        """Put the moves decided since the last step on ``step`` (or on a step of only them)."""
        if not self._ops:
            return step
        s = self.s
        if step is None:
            step = build_step(next(s._step_ids), [], s.blocks, s._freed_seq_ids, [], [])
            s._freed_seq_ids = []
            s._in_flight.add(step.step_id, [])
        ops, self._ops = self._ops, []
        step.migrate_ops = np.array([(k, b, i) for i, (k, b, _) in enumerate(ops)], np.int64).reshape(-1, 3)
        step.migrate_keys = [key for _, _, key in ops]
        step.migrate_dir = self.directory
        self._steps[step.step_id] = [key for kind, _, key in ops if kind != DELETE]
        return step

    def update(self, result) -> None:
        """After ``Scheduler.update``: the moves of ``result``'s step are done (or failed)."""
        keys = self._steps.pop(result.step_id, None)
        if keys is None:
            return
        failed = set(result.migrate_failed) | (set(keys) if result.error is not None else set())
        for out in self.outgoing.values():
            out.failed |= bool(out.pending & failed)
            out.pending -= set(keys)
        for entry in self.prefetched.values():
            if entry.pending & failed:
                entry.status = "refused: a block file could not be read"
            entry.pending -= set(keys)
        for request_id, entry in self.incoming.items():
            if entry.status != "importing" or not entry.pending & set(keys):
                continue
            bad = entry.pending & failed
            entry.pending -= set(keys)
            if bad:
                self._drop_import(request_id, entry, "a block file could not be read")
            elif not entry.pending:
                self._accept(request_id, entry)

    def _accept(self, request_id: str, entry: _In) -> None:
        if request_id not in self.s.groups:  # aborted meanwhile
            entry.status = "refused: aborted"
            return
        entry.seq.status = SequenceStatus.RUNNING
        self.s._insert_running(entry.seq)
        entry.status = "accepted"

    def _drop_import(self, request_id: str, entry: _In, why: str) -> None:
        self.s.blocks.free(entry.seq.seq_id)
        self.s.groups.pop(request_id, None)
        entry.seq.finish_reason = None
        entry.status = f"refused: {why}"

    def reset(self) -> None:
        """After ``Scheduler.reset_executor_state``: nothing in flight moved. Every import is
        refused (its blocks went with the pool); every outgoing request fails its migration and, if
        paused, waits here to be prefilled again with its tokens (as the others do)."""
        self._steps.clear()
        self._ops = []
        self.prefetched.clear()  # their blocks went with the pool
        for request_id, entry in self.incoming.items():
            if entry.status == "importing":
                self.s.groups.pop(request_id, None)
                entry.status = "refused: the executors restarted"
        for out in self.outgoing.values():
            out.failed, out.pending, out.written = True, set(), 0
            if out.paused and out.seq.finish_reason is None:
                out.seq.num_computed_tokens = 0
                self.s.waiting.appendleft(out.seq)
                out.paused = False

