"""The launcher's count of the processes it replaced, handed to its frontend in a file for /metrics
and /health.

``pagedserve serve``'s launcher replaces every process of its host that ends, one killed while it
starts up included: such a process may end before any other process heard of it, so only the
launcher can count it. The launcher writes its counts (process name -> restarts; the executor ranks
restart together and count as one) to ``restarts.json`` in its private socket directory, at start
(all zero) and after each restart, and names the file to its children in
``PAGEDSERVE_RESTARTS_FILE``; the frontend reads it whenever /metrics or /health is asked, so the
counts outlive a restarted frontend or scheduler. The file is replaced whole (written under
another name, then renamed): a reader never sees half of it.
"""

from __future__ import annotations

import json
import os

ENV_VAR = "PAGEDSERVE_RESTARTS_FILE"
FILE_NAME = "restarts.json"


def restarts_path(sock_dir: str) -> str:
    return os.path.join(sock_dir, FILE_NAME)


def write_restart_counts(path: str, counts: dict[str, int]) -> None:
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(counts, f)
    os.replace(partial, path)


def read_restart_counts(path: str | None) -> dict[str, int] | None:
    """The counts in ``path``; None when there is no path or no readable file (serve is stopping)."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            counts = json.load(f)
    except (OSError, ValueError):
        return None
    return {str(name): int(num) for name, num in counts.items()} if isinstance(counts, dict) else None


def supervised_or_observed(observed: dict[str, int], path: str | None) -> dict[str, int]:
    """Restarts by process: the launcher's count for each process it supervises (``path``), the
    ``observed`` count (seen by the processes themselves) for the others."""
    return {**observed, **(read_restart_counts(path) or {})}
