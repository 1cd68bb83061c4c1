"""How often a supervised process may be restarted: ``--max-restarts`` within ``--restart-window-s``.
Plain Python, no I/O; times are passed in (``time.monotonic()`` seconds)."""

from __future__ import annotations

from collections import defaultdict, deque

from shared.engine_flags import SupervisorFlags

_DEFAULTS = SupervisorFlags()  # the flags' defaults, declared there once


class RestartBudget:
    """At most ``max_restarts`` restarts of each process within any ``window_s`` seconds."""

    def __init__(self, max_restarts: int = _DEFAULTS.max_restarts,
                 window_s: float = _DEFAULTS.restart_window_s) -> None:
        if max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
        if not window_s > 0:
            raise ValueError(f"--restart-window-s must be positive, got {window_s}")
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: dict[str, deque[float]] = defaultdict(deque)  # restarts inside the window
        self.num_restarts: dict[str, int] = defaultdict(int)  # over the whole run

    def allow(self, process: str, now: float) -> bool:
        """Whether ``process`` may be restarted now; if so, the restart is counted."""
        times = self._times[process]
        while times and now - times[0] >= self.window_s:
            times.popleft()
        if len(times) >= self.max_restarts:
            return False
        times.append(now)
        self.num_restarts[process] += 1
        return True

    def refusal(self, process: str) -> str:
        """Why ``allow`` said no, with the flags to change."""
        num = self.max_restarts + 1
        return (f"the {process} process failed {num} time{'s' if num > 1 else ''} within {self.window_s:g} s "
                f"(--max-restarts {self.max_restarts}, --restart-window-s {self.window_s:g})")
