"""Heartbeat files: a process shows that its main loop still turns by touching a file.

A healthcheck in a container (``pagedserve health scheduler``) cannot ask a process that has no
HTTP port, so the scheduler and each executor rank touch ``<dir>/<name>.heartbeat`` from their
loops, at most once per ``MIN_INTERVAL_S``; the check reads the file's age. ``<dir>`` is
``$PAGEDSERVE_HEALTH_DIR``, else ``pagedserve-<uid>`` under ``$XDG_RUNTIME_DIR`` or the temporary
directory. A process removes a stale file of its name when it starts, so a restarted process is
not reported alive before its loop runs. Processes of several servers on one host share the
default directory; give each its own ``PAGEDSERVE_HEALTH_DIR`` (each container has its own).
"""

from __future__ import annotations

import os
import tempfile
import time

MIN_INTERVAL_S = 1.0


def health_dir() -> str:
    explicit = os.environ.get("PAGEDSERVE_HEALTH_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"pagedserve-{os.getuid()}")


def heartbeat_path(name: str, directory: str | None = None) -> str:
    return os.path.join(directory or health_dir(), f"{name}.heartbeat")


class Heartbeat:
    """Touches ``heartbeat_path(name)``; ``beat()`` is cheap enough to call on every loop turn."""

    def __init__(self, name: str, directory: str | None = None, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.path = heartbeat_path(name, directory)
        self.min_interval_s = min_interval_s
        self._last_beat = float("-inf")
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        try:
            os.unlink(self.path)  # a stale file from an earlier process of this name
        except FileNotFoundError:
            pass

    def beat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat < self.min_interval_s:
            return
        self._last_beat = now
        try:
            with open(self.path, "a"):
                pass
            os.utime(self.path)
        except OSError:
            pass  # a full or read-only disk must not stop the engine; the check will fail instead


def heartbeat_age_s(name: str, directory: str | None = None) -> float | None:
    """Seconds since the last beat of ``name`` (wall clock), or ``None`` when it never beat."""
    try:
        return max(0.0, time.time() - os.stat(heartbeat_path(name, directory)).st_mtime)
    except FileNotFoundError:
        return None
