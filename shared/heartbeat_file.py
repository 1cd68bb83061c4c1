"""Heartbeat files: a process shows that its main loop still turns by touching a file.

A healthcheck in a container (``pagedserve health scheduler``) cannot ask a process that has no
HTTP port, so the scheduler and each executor rank touch ``$PAGEDSERVE_HEALTH_DIR/<name>.heartbeat``
from their loops, at most once per ``MIN_INTERVAL_S``; the check reads the file's age. Without
``PAGEDSERVE_HEALTH_DIR`` nothing is written (``pagedserve serve`` watches its children itself and
leaves no file behind); the image sets it to a directory in the container's own /tmp. A process
removes a stale file of its name when it starts, so a restarted process is not reported alive
before its loop runs. (Unrelated to the wire ``shared.messages.Heartbeat``, by which executor ranks
tell the scheduler they live.)
"""

from __future__ import annotations

import os
import time

MIN_INTERVAL_S = 1.0


def health_dir() -> str | None:
    return os.environ.get("PAGEDSERVE_HEALTH_DIR") or None


def heartbeat_path(name: str, directory: str) -> str:
    return os.path.join(directory, f"{name}.heartbeat")


class HeartbeatFile:
    """Touches ``<directory>/<name>.heartbeat`` (``directory``: default ``$PAGEDSERVE_HEALTH_DIR``;
    neither: does nothing). ``beat()`` is cheap enough to call on every loop turn."""

    def __init__(self, name: str, directory: str | None = None, min_interval_s: float = MIN_INTERVAL_S) -> None:
        directory = directory or health_dir()
        self.path = heartbeat_path(name, directory) if directory else None
        self.min_interval_s = min_interval_s
        self._last_beat = float("-inf")
        if self.path is None:
            return
        os.makedirs(directory, mode=0o700, exist_ok=True)
        try:
            os.unlink(self.path)  # a stale file from an earlier process of this name
        except FileNotFoundError:
            pass

    def beat(self) -> None:
        now = time.monotonic()
        if self.path is None or now - self._last_beat < self.min_interval_s:
            return
        self._last_beat = now
        try:
            with open(self.path, "a"):
                pass
            os.utime(self.path)
        except OSError:
            pass  # a full or read-only disk must not stop the engine; the check will fail instead


def heartbeat_age_s(name: str, directory: str) -> float | None:
    """Seconds since the last beat of ``name`` (wall clock), or ``None`` when it never beat."""
    try:
        return max(0.0, time.time() - os.stat(heartbeat_path(name, directory)).st_mtime)
    except FileNotFoundError:
        return None
