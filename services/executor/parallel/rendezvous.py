"""The start-up handshake of a rank group: every rank publishes its handle bytes, reads all of them.

The transport is a ``torch.distributed`` key-value store, which stores raw bytes (never pickle):
a ``FileStore`` on a file in the launcher's private socket directory when all ranks share a host,
a ``TCPStore`` (the one ``--dist-init-addr`` names) across hosts. Keys are ``{prefix}/{rank}``,
so one store can serve several handshakes.
"""

from __future__ import annotations

import datetime

from .base import GroupError


def file_store(path: str, world_size: int):
    """A store every rank on this host opens with the same ``path``."""
    from torch.distributed import FileStore

    return FileStore(path, world_size)


def exchange_handles(store, rank: int, world_size: int, handle: bytes, timeout_s: float = 60.0,
                     prefix: str = "handle") -> list[bytes]:
    """Publish ``handle`` as rank ``rank`` and return every rank's handle, indexed by rank.

    Raises ``GroupError`` naming the ranks that did not publish within ``timeout_s``.
    """
    store.set(f"{prefix}/{rank}", handle)
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # torch raises DistStoreError (a RuntimeError) on timeout
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise GroupError(f"ranks {missing} did not publish their handle within {timeout_s:g} s "
                         f"(rank {rank} waited): {exc}", missing[0] if missing else None) from exc
    return [bytes(store.get(key)) for key in keys]
