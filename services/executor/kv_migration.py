"""The executor's side of live migration between data-parallel replicas: a step's ``migrate_ops``
(``services/scheduler/migration_desk.py`` decides them) write device blocks' bytes to files, or read
files into device blocks, before the step's other block moves.

The transport is the KV tiers' block file (``kv_files.BlockFiles``: header, digest, BLAKE2b
checksum, atomic rename) in a directory every replica of the host shares (``migrate_dir``, on
tmpfs by default): no segment to size or clean up after a crash, a source that dies leaves whole
files or none, and the digest (dtype, KV dtype, block shape, tensor-parallel rank and size) keeps a
replica of another shape from reading them. Each tensor-parallel rank writes and reads its own
shard of every block. A read that fails (missing, corrupt, foreign) on any rank is reported in
``StepResult.migrate_failed`` (the ranks agree by an all-reduce) and the scheduler drops the import.
"""

from __future__ import annotations

import numpy as np
import structlog
import torch

from .kv_files import BlockFiles
from .parallel.base import failed_on_any_rank

log = structlog.get_logger()
EXPORT, IMPORT, DELETE = 1, 2, 3  # services/scheduler/migration_desk.py


class BlockMover:
    """Moves device blocks to and from a migration directory's files."""

    def __init__(self, kv_caches, comm=None, device: torch.device | None = None) -> None:
        self.kv_caches, self.comm, self.device = kv_caches, comm, device
        k = kv_caches[0][0]
        rank, world = (comm.rank, comm.world_size) if comm is not None else (0, 1)
        self.fields = {"format": "migration-1", "kv_dtype": str(k.dtype), "num_layers": len(kv_caches),
                       "block_shape": list(k.shape[1:]), "tp_rank": rank, "tp_size": world}
        self.payload_bytes = sum(t[0].numel() * t.element_size() for pair in kv_caches for t in pair)
        self._files: dict[str, BlockFiles] = {}

    def apply(self, ops: np.ndarray, keys: list[bytes], directory: str) -> list[bytes]:
        """Run ``ops`` in order; returns the keys that failed (on any rank)."""
        files = self._files.get(directory)
        if files is None:
            files = self._files[directory] = BlockFiles(directory, self.fields)
        failed = []
        for kind, block, index in ops.tolist():
            key = keys[index]
            if kind == DELETE:  # an aborted migration's files
                files.delete(key)
                ok = True
            else:
                ok = self._export(files, block, key) if kind == EXPORT else self._import(files, block, key)
            failed.append(not ok)
        return self._agree(keys, ops, failed)

    def _export(self, files: BlockFiles, block: int, key: bytes) -> bool:
        payload = b"".join(t[block].contiguous().view(torch.uint8).cpu().numpy().tobytes()
                           for pair in self.kv_caches for t in pair)
        try:
            files.write(key, payload)
            return True
        except OSError as exc:
            log.warning("migration block write failed", key=key.hex(), error=str(exc))
            return False

    def _import(self, files: BlockFiles, block: int, key: bytes) -> bool:
        payload, why = files.read(key, self.payload_bytes)
        files.delete(key)  # read once: the target owns the bytes now
        if payload is None:
            log.warning("migration block not imported", key=key.hex(), reason=why)
            return False
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for pair in self.kv_caches:
            for t in pair:
                dst = t[block]
                n = dst.numel() * dst.element_size()
                dst.view(-1).view(torch.uint8).copy_(raw[offset:offset + n].to(dst.device))
                offset += n
        return True

    def _agree(self, keys: list[bytes], ops: np.ndarray, failed: list[bool]) -> list[bytes]:
        failed = failed_on_any_rank(self.comm, failed, self.device)
        return [keys[int(i)] for (_, _, i), bad in zip(ops.tolist(), failed) if bad]
