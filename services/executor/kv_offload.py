"""The executor's side of the KV offload tiers: a host pool (``--kv-offload-memory``) and the block
files (``--kv-offload-dir``, ``kv_files``). The scheduler decides every move (its books:
``services/scheduler/kv_tiers.py``); this applies a step's ``tier_ops`` in order, before the step's
other block moves:

- ``OFFLOAD``/``RELOAD``: whole-block copies device pool <-> host pool (the swap kernels).
- ``SPILL``: the host slot's bytes are copied out at once (a later move may reuse the slot) and
  written by a thread, off the step's critical path; ``DELETE`` goes through the same thread, in
  order. Each write's outcome is reported in a later ``StepResult`` (``tier_stored`` or
  ``tier_store_failed``, a full disk...), so the scheduler only counts a file once it exists.
- ``LOAD``: the file is read and checked in the step (a run of them on ``READ_THREADS`` threads) (the sequence that needs it waits, the batch
  does not: the scheduler admits it once this step's result says ``tier_loaded``). A file that is
  missing, truncated, foreign or corrupt is logged, deleted and reported ``tier_load_failed``; with
  several ranks they agree (an all-reduce) so that a block is loaded on all of them or on none.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import structlog
import torch

from shared.messages import Step, StepResult

from .kv_files import HEADER_BYTES, BlockFiles
from .parallel.base import failed_on_any_rank

log = structlog.get_logger()
OFFLOAD, RELOAD, SPILL, LOAD, DELETE = 1, 2, 3, 4, 5  # services/scheduler/kv_tiers.py TierOp
READ_THREADS = 4


class KvOffload:
    def __init__(self, host_caches, files: BlockFiles | None = None, disk_bytes: int = 0, world_size: int = 1,
                 comm=None, device: torch.device | None = None) -> None:
        self.host = host_caches  # per layer (keys, values), [slots, heads, block_size, head_dim], CPU
        self.files, self.comm, self.device = files, comm, device
        # the pool's bytes, [slots, bytes a slot] per layer's keys then values (views, made once)
        self._rows = [t.view(torch.uint8).numpy().reshape(t.shape[0], -1) for pair in host_caches for t in pair]
        self.payload_bytes = sum(t[0].numel() * t.element_size() for pair in host_caches for t in pair)
        self.num_disk_blocks = disk_bytes // ((HEADER_BYTES + self.payload_bytes) * world_size) if files else 0
        self.startup_keys: list[bytes] = []
        self._loaded: list[bytes] = []
        self._load_failed: list[bytes] = []
        self._stored: list[bytes] = []
        self._store_failed: list[bytes] = []
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        if files is not None:
            self.startup_keys, ignored = files.listing(self.payload_bytes)
            log.info("kv offload directory", path=str(files.dir), num_blocks=len(self.startup_keys),
                     num_disk_blocks=self.num_disk_blocks, ignored=len(ignored), ignored_names=ignored[:5],
                     other_digests=files.foreign_digests())
            threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True).start()
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-offload-reader")

    @property
    def num_host_blocks(self) -> int:
        return self.host[0][0].shape[0]

    def apply(self, step: Step, kv_caches, backend) -> None:
        """Run ``step.tier_ops`` in order; runs of copies one way go in one kernel call."""
        ops, keys = step.tier_ops, step.tier_keys
        loads: list[tuple[bytes, bool]] = []
        i = 0
        while i < len(ops):
            kind = int(ops[i, 0])
            j = i + 1
            while kind in (OFFLOAD, RELOAD) and j < len(ops) and int(ops[j, 0]) == kind:
                j += 1
            if kind in (OFFLOAD, RELOAD):
                mapping = torch.from_numpy(np.ascontiguousarray(ops[i:j, 1:]))
                for (k, v), (hk, hv) in zip(kv_caches, self.host):
                    for dst, src in (((hk, k), (hv, v)) if kind == OFFLOAD else ((k, hk), (v, hv))):
                        backend.swap_blocks(dst, src, mapping)
            elif kind == SPILL:
                self._queue.put(("write", keys[int(ops[i, 2])], self._snapshot(int(ops[i, 1]))))
            elif kind == LOAD:  # a run of reads at once, on threads (reading and hashing release the GIL)
                while j < len(ops) and int(ops[j, 0]) == LOAD:
                    j += 1
                run = [(keys[int(a)], int(b)) for a, b in ops[i:j, 1:].tolist()]
                loads += [(key, self._load(key, slot, payload))
                          for (key, slot), payload in zip(run, self._readers.map(self.files.read, [k for k, _ in run],
                                                                                  [self.payload_bytes] * len(run)))]
            elif kind == DELETE:
                self._queue.put(("delete", keys[int(ops[i, 1])], None))
            i = j
        if loads:
            self._agree(loads)

    def _snapshot(self, slot: int) -> bytes:
        return b"".join(view.tobytes() for view in self._slot_views(slot))

    def _load(self, key: bytes, slot: int, read: tuple[bytes | None, str]) -> bool:
        payload, why = read
        if payload is None:
            log.warning("kv offload file not served", key=key.hex(), reason=why, path=str(self.files.path(key)))
            if not why.startswith("missing"):
                self.files.delete(key)
            return False
        raw = np.frombuffer(payload, np.uint8)
        offset = 0
        for dst in self._slot_views(slot):  # numpy's copies: a tenth of torch's per-call cost here
            dst[:] = raw[offset:offset + dst.size]
            offset += dst.size
        return True

    def _slot_views(self, slot: int) -> list[np.ndarray]:
        """The host slot's bytes, every layer's keys then values, as flat uint8 arrays."""
        return [rows[slot] for rows in self._rows]

    def _agree(self, loads: list[tuple[bytes, bool]]) -> None:
        """Every rank's verdict on each load: loaded only where all ranks loaded it."""
        failed = failed_on_any_rank(self.comm, [not good for _, good in loads], self.device)
        with self._lock:
            for (key, _), bad in zip(loads, failed):
                (self._load_failed if bad else self._loaded).append(key)

    def _write_loop(self) -> None:
        while True:
            kind, key, payload = self._queue.get()
            try:
                if kind == "write":
                    self.files.write(key, payload)
                else:
                    self.files.delete(key)
                ok = True
            except OSError as exc:
                ok = False
                log.warning("kv offload write failed", key=key.hex(), op=kind, error=str(exc))
            if kind == "write":
                with self._lock:
                    (self._stored if ok else self._store_failed).append(key)
            self._queue.task_done()

    def report(self, result: StepResult) -> StepResult:
        """Put what finished since the last report into ``result``."""
        with self._lock:
            result.tier_loaded, self._loaded = self._loaded, []
            result.tier_load_failed, self._load_failed = self._load_failed, []
            result.tier_stored, self._stored = self._stored, []
            result.tier_store_failed, self._store_failed = self._store_failed, []
        return result

    def ready_fields(self) -> dict:
        """``ExecutorReady``'s tier fields; the files listed now (a new scheduler's index)."""
        keys = self.files.listing(self.payload_bytes)[0] if self.files is not None else []
        return {"num_host_offload_blocks": self.num_host_blocks, "num_disk_offload_blocks": self.num_disk_blocks,
                "offloaded_keys": keys}

    def flush(self) -> None:
        """Wait until every queued write and delete is done (tests; a stopping executor)."""
        if self.files is not None:
            self._queue.join()
