"""CPU thread pools of the executor: how many threads, and how idle OpenMP threads wait.

The rule (``choose_threads``), from what a process reads at start-up in well under a millisecond:

- cores: the CPUs this process may run on (``os.sched_getaffinity``: taskset, cpusets), capped by
  a cgroup CPU quota (``docker --cpus``, Kubernetes limits), counted once per physical core
  (two SMT siblings of one core share its vector units: a second matmul thread there only
  contends).
- threads: every such core, less one when there are at least ``RESERVE_FROM_CORES`` of them and
  the frontend and scheduler run on the same machine (``colocated``), so that those two Python
  processes never take a core an OpenMP thread is waiting for. Below that, every core computes:
  on two cores, giving one of two to processes that need a few percent of one halves the
  executor for nothing.
- waiting: ``OMP_WAIT_POLICY=PASSIVE`` always. torch and Numba bring two GNU OpenMP runtimes
  (torch's bundled libgomp; Numba's ``omp`` layer links the system's), so every layer alternates
  between two thread pools on the same cores, and an idle thread of one pool that spins takes
  the core a thread of the other pool needs. ``PAGEDSERVE_NUM_THREADS`` or ``--num-threads``
  overrides the count, an ``OMP_WAIT_POLICY`` already set overrides the policy.

Measured with ``flock /tmp/bench.lock python -m loadtest.threads --steps 8`` (SmolLM2 decode in
bf16, the ``--dtype auto`` of this CPU, batch 32, context 256; median of 8 steps, then of 2
interleaved rounds; a 2-core AMD EPYC Zen 5 VM with avx512_bf16, shared with other helpers'
tests and benchmarks, so only the large ratios are to be trusted). Wall ms per step (ratio to the
best setting of the same neighbour):

    run 1, load average 3.4 -> 3.0          alone          light neighbour   heavy neighbour
    1 thread                                66.9 (x1.56)   68.5 (x1.56)      128.5 (x1.62)
    2 threads, PASSIVE                      60.2 (x1.41)   66.9 (x1.53)       79.1 (x1.00)
    2 threads, libgomp default              42.9 (x1.00)   44.8 (x1.02)     1283.4 (x16.22)
    2 threads, ACTIVE                       44.5 (x1.04)   43.8 (x1.00)       80.3 (x1.02)

    run 2 (after the fused norm/rotary kernels), load average 3.5 -> 3.3
    1 thread                                96.3 (x1.00)   87.0 (x1.00)      119.9 (x1.31)
    2 threads, PASSIVE                     105.9 (x1.10)   96.0 (x1.10)       91.4 (x1.00)
    2 threads, libgomp default             436.2 (x4.53)  467.6 (x5.38)      242.4 (x2.65)
    2 threads, ACTIVE                      418.3 (x4.34)  780.3 (x8.97)      321.7 (x3.52)
    2 threads, GOMP_SPINCOUNT=10000        230.3 (x2.39)  178.6 (x2.05)      229.3 (x2.51)

Spinning (libgomp's default, ACTIVE, or a short spin count) was up to 1.5x faster in one run and
2 to 16 times slower in the other, depending on what else ran on the two cores; PASSIVE was never
worse than 1.53x the best and was the best with a heavy neighbour in both runs, and an idle
ACTIVE pool would also keep a core busy between requests. So PASSIVE stays, on every machine. On
two cores both threads compute: one thread alone lost to two by 1.31x to 1.62x next to a heavy
neighbour and won by at most 1.10x without one. No machine with 8 or more cores was available: the reserved core
(``RESERVE_FROM_CORES``) is a design choice that is not measured yet.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

RESERVE_FROM_CORES = 8  # from this many cores on, one is left to a colocated frontend and scheduler


@dataclass(frozen=True)
class ThreadChoice:
    num_threads: int
    reason: str


def set_thread_env() -> None:
    """Call before importing torch or numba (the OpenMP runtimes read these once)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("KMP_BLOCKTIME", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time the cgroup quota allows (cgroup v2 ``cpu.max`` or v1 ``cfs_quota``), or
    None without a quota."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def physical_cores(cpus: set[int], sysfs: str = "/sys/devices/system/cpu") -> int:
    """How many physical cores ``cpus`` cover (SMT siblings counted once; a CPU whose topology
    cannot be read counts as a core of its own)."""
    cores = set()
    for cpu in cpus:
        try:
            with open(os.path.join(sysfs, f"cpu{cpu}", "topology", "thread_siblings_list")) as f:
                cores.add(f.read().strip())
        except OSError:
            cores.add(f"cpu{cpu}")
    return len(cores)


def usable_cores() -> tuple[int, str]:
    """(physical cores this process may use, how they were counted)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = physical_cores(cpus)
    how = f"{len(cpus)} CPUs allowed, {cores} physical cores"
    limit = cgroup_cpu_limit()
    if limit is not None and math.floor(limit) < cores:
        cores = max(1, math.floor(limit))
        how += f", cgroup quota of {limit:g} CPUs"
    return cores, how


def choose_threads(num_threads: int | None, colocated: bool = True, cores: tuple[int, str] | None = None) -> ThreadChoice:
    """The executor's thread count: ``num_threads`` (or ``PAGEDSERVE_NUM_THREADS``) when given,
    else the rule of this module's docstring. ``colocated``: the frontend and scheduler share
    the machine (they do under ``pagedserve serve``)."""
    asked = num_threads or int(os.environ.get("PAGEDSERVE_NUM_THREADS", 0) or 0)
    if asked:
        return ThreadChoice(asked, "--num-threads / PAGEDSERVE_NUM_THREADS")
    count, how = cores or usable_cores()
    if colocated and count >= RESERVE_FROM_CORES:
        return ThreadChoice(count - 1, f"{how}; one left to the frontend and scheduler")
    return ThreadChoice(count, how)


def configure_cpu_threads(num_threads: int | None, colocated: bool = True) -> ThreadChoice:
    """Give torch and Numba the same pool size (``choose_threads``); returns the choice."""
    set_thread_env()
    import torch

    choice = choose_threads(num_threads, colocated)
    n = choice.num_threads
    torch.set_num_threads(n)
    try:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    return choice
