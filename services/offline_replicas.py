"""Data-parallel replicas in one process, with live migration between them: several ``EngineCore``s
(each its own scheduler, block manager and model runner with its KV pool) stepped in turn, and
``migrate`` moving a running request from one to another with its KV blocks (``services/scheduler/
migration.py``: pre-copy, pause, seal, import, commit). Block files go through ``directory`` (a
temporary directory, on tmpfs where there is one). The outputs of every replica come out of
``step`` in one list; a migrated request's stream continues from its new replica with no token
repeated or missing. ``check_integrity`` after each step checks every replica's block manager.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile

import structlog

from services.offline import EngineCore
from services.scheduler.migration import Migration, MigrationError, Phase
from shared.messages import AddRequest, RequestOutput

log = structlog.get_logger()


def migration_directory() -> str:
    """A fresh private directory for block files, in /dev/shm when it exists (memory, not disk)."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="pagedserve-migrate-", dir=root)


class ReplicatedEngine:
    def __init__(self, cores: list[EngineCore], directory: str | None = None, check: bool = False) -> None:
        if len(cores) < 2:
            raise ValueError("migration needs at least two replicas")
        self.cores = cores
        self._own_dir = directory is None
        self.directory = directory or migration_directory()
        for core in cores:
            core.migrations.directory = self.directory
        self.owner: dict[str, int] = {}  # request id -> replica running it
        self.migrations: dict[str, Migration] = {}  # in progress, by request id
        self.finished: list[Migration] = []
        self.check = check
        self._ids = itertools.count()
        self._prefetching: set[str] = set()  # requests whose pre-copied blocks the target was asked to read

    def add_request(self, request: AddRequest, replica: int = 0) -> None:
        self.owner[request.request_id] = replica
        self.cores[replica].add_request(request)

    def abort_request(self, request_id: str) -> None:
        replica = self.owner.pop(request_id, None)
        if replica is not None:
            self.cores[replica].abort_request(request_id)

    def has_work(self) -> bool:
        return any(c.has_work() for c in self.cores) or bool(self.migrations)

    def migrate(self, request_id: str, to: int | None = None) -> Migration:
        """Start moving ``request_id`` to replica ``to`` (default: the next one); ``MigrationError``
        (a ``ValueError``) if it cannot (unknown, finished, n > 1, guided...)."""
        source = self.owner.get(request_id)
        if source is None:
            raise MigrationError(f"unknown request {request_id}")
        to = (source + 1) % len(self.cores) if to is None else to
        if not 0 <= to < len(self.cores) or to == source:
            raise MigrationError(f"replica {to}: not another replica of {len(self.cores)}")
        migration = Migration(f"m{os.getpid()}-{next(self._ids)}", request_id, source, to)
        self.cores[source].migrations.begin_out(request_id, migration.migration_id)
        self.migrations[request_id] = migration
        return migration

    def step(self) -> list[RequestOutput]:
        """One step of every replica, then each migration's next move."""
        outputs: list[RequestOutput] = []
        for i, core in enumerate(self.cores):
            if core.has_work() or core.migrations._ops:
                for out in core.step():
                    if self.owner.get(out.request_id) == i:
                        outputs.append(out)
                        if out.request_finished or out.error is not None:
                            self.owner.pop(out.request_id, None)
            if self.check:
                core.blocks.check_integrity()
        for migration in list(self.migrations.values()):
            self._advance(migration)
        return outputs

    def _advance(self, m: Migration) -> None:
        source, target = self.cores[m.source].migrations, self.cores[m.target].migrations
        if m.phase is Phase.PRECOPY:
            if source.outgoing_failed(m.request_id):
                return self._abort(m, "the request ended or a block write failed")
            if m.request_id not in self._prefetching:  # the target reads what is written meanwhile
                keys = source.written_keys(m.request_id)
                if keys is None:
                    return
                self._prefetching.add(m.request_id)
                if target.prefetch_in(m.request_id, keys):
                    return  # pause after the target's next step has read them
            if source.pause(m.request_id):
                m.to(Phase.PAUSED)
        if m.phase is Phase.PAUSED:
            if source.outgoing_failed(m.request_id):
                return self._abort(m, "the request ended or a block write failed")
            state = source.sealed(m.request_id)
            if state is None:
                return
            m.to(Phase.SEALED)
            try:
                target.begin_in(state)
            except MigrationError as exc:
                return self._abort(m, f"the target refused: {exc}")
            m.to(Phase.IMPORTING)
        if m.phase is Phase.IMPORTING:
            status = target.incoming_status(m.request_id)
            if status == "accepted":
                source.commit_out(m.request_id)
                target.incoming_status(m.request_id, forget=True)
                self.owner[m.request_id] = m.target
                self._end(m, Phase.DONE)
            elif status.startswith("refused"):
                target.incoming_status(m.request_id, forget=True)
                self._abort(m, f"the target {status}")

    def _abort(self, m: Migration, reason: str) -> None:
        self.cores[m.source].migrations.abort_out(m.request_id)
        self.cores[m.target].migrations.drop_prefetch(m.request_id)
        self._end(m, Phase.ABORTED, reason)

    def _end(self, m: Migration, phase: Phase, reason: str = "") -> None:
        m.to(phase, reason)
        del self.migrations[m.request_id]
        self._prefetching.discard(m.request_id)
        self.finished.append(m)
        log.info("migration ended", migration_id=m.migration_id, request_id=m.request_id, phase=str(phase),
                 source=m.source, target=m.target, reason=reason)

    def close(self) -> None:
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
