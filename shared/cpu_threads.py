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
- runtime: one GNU OpenMP runtime for torch and Numba (``shared/openmp.py``: Numba's libgomp is
  loaded before torch, which then binds to it), so that both run their parallel regions on the
  same worker threads.
- waiting: with one runtime, an idle worker spins ``SPIN_COUNT`` times (``GOMP_SPINCOUNT``, about
  2 ms here), then sleeps: the regions of a layer follow each other within microseconds, and a
  worker that slept pays a wake-up at each. Where the runtimes could not be shared (another
  threading layer, no system libgomp, ``PAGEDSERVE_SHARE_OPENMP=0``), ``OMP_WAIT_POLICY=PASSIVE``:
  with two pools on the same cores, a spinning worker of one holds the core a worker of the other
  needs (the tables below). ``PAGEDSERVE_NUM_THREADS`` or ``--num-threads`` overrides the count;
  an ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` already set overrides the waiting.

Measured with ``flock /tmp/bench.lock python -m loadtest.profile.thread_settings --steps 8`` (SmolLM2 decode in
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

Runs 1 and 2 had two runtimes (torch's and Numba's). Spinning there was up to 1.5x faster in
one run and 2 to 16 times slower in the other: PASSIVE was the rule until the runtimes were shared.

    run 3 (python -m loadtest.profile.thread_settings --steps 8, 2026-12-01, load average 1.2, same machine)
                                            alone          light neighbour   heavy neighbour
    1 thread                                56.7 (x1.53)   55.5 (x1.24)       59.5 (x1.00)
    separate runtimes, PASSIVE              50.1 (x1.35)   54.5 (x1.22)       62.4 (x1.05)
    separate runtimes, GOMP_SPINCOUNT=2e5   37.1 (x1.00)   52.6 (x1.17)       90.1 (x1.51)
    one runtime, PASSIVE                    44.5 (x1.20)   62.6 (x1.40)       72.6 (x1.22)
    one runtime, GOMP_SPINCOUNT=2e5 (rule)  40.3 (x1.09)   47.9 (x1.07)      102.9 (x1.73)
    one runtime, ACTIVE                     40.0 (x1.08)   44.8 (x1.00)       98.5 (x1.66)

In the server (``loadtest.bench.throughput``, 64 requests, bf16, one server at a time, output tok/s,
the old rule / one runtime spinning 200,000 times): 402 / 582 and 431 / 528 in two interleaved
rounds; with the runtime shared by hand before this module did it, 612 / 663, 545 / 655 and 519 /
596. (A first version shared it in-process but not in the server, whose executor imported torch
first, so torch's runtime spun by libgomp's default and Numba's slept: 454 and 548 beside the two
rounds above.) So with one runtime the executor spins, on every machine: 1.05x to 1.2x faster per
step alone or beside a light neighbour. Beside a heavy one (busy two thirds of one core), the
spinning worker takes CPU time the other threads need and two threads spinning were 1.7x slower
than one thread; there the thread tuner
(``services/executor/thread_tuner.py``) moves a step to one thread, which does not spin, wherever
it may (not in the float32 exactness mode, whose count is fixed). On two cores both threads
compute otherwise. No machine with 8 or more cores was available: the reserved core
(``RESERVE_FROM_CORES``) is a design choice that is not measured yet.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from shared.openmp import share_runtime

RESERVE_FROM_CORES = 8  # from this many cores on, one is left to a colocated frontend and scheduler
SPIN_COUNT = 200_000  # libgomp spins of an idle worker before it sleeps, with one runtime


@dataclass(frozen=True)
class ThreadChoice:
    num_threads: int
    reason: str
    openmp: str = ""  # the OpenMP runtime(s) and how their idle threads wait, for the log


def set_thread_env() -> None:
    """Call before importing torch or numba (the OpenMP runtimes read these once). How idle OpenMP
    threads wait is the executor's choice (``configure_cpu_threads``)."""
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


def asked_threads(num_threads: int | None = None) -> int:
    """The thread count the operator asked for: ``num_threads`` (``--num-threads``), else
    ``PAGEDSERVE_NUM_THREADS``; 0 when neither (or 0) was given."""
    return num_threads or int(os.environ.get("PAGEDSERVE_NUM_THREADS", 0) or 0)


def choose_threads(num_threads: int | None, colocated: bool = True, cores: tuple[int, str] | None = None) -> ThreadChoice:
    """The executor's thread count: ``num_threads`` (or ``PAGEDSERVE_NUM_THREADS``) when given,
    else the rule of this module's docstring. ``colocated``: the frontend and scheduler share
    the machine (they do under ``pagedserve serve``)."""
    asked = asked_threads(num_threads)
    if asked:
        return ThreadChoice(asked, "--num-threads / PAGEDSERVE_NUM_THREADS")
    count, how = cores or usable_cores()
    if colocated and count >= RESERVE_FROM_CORES:
        return ThreadChoice(count - 1, f"{how}; one left to the frontend and scheduler")
    return ThreadChoice(count, how)


_openmp: str | None = None  # what prepare_openmp chose, once per process
_spinning = False  # whether it left one runtime whose idle threads spin


def idle_threads_spin() -> bool:
    """Whether ``prepare_openmp`` gave torch and Numba one OpenMP runtime whose idle threads spin
    before they sleep: then a parallel region right after another (a Numba kernel after a torch
    matmul) finds its threads awake, and small row kernels can pay to run in parallel
    (``NumbaCPUBackend.parallel_small_rows``). False before ``prepare_openmp``, with two runtimes,
    and where ``OMP_WAIT_POLICY=PASSIVE`` or ``GOMP_SPINCOUNT=0`` puts them to sleep at once."""
    return _spinning


def _spins(env) -> bool:
    if env.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE":
        return False
    try:
        return int(env.get("GOMP_SPINCOUNT", "1").strip() or "1") != 0
    except ValueError:  # a count with a suffix (libgomp takes "10k", "1M", "infinite"): it spins
        return True


def prepare_openmp() -> str:
    """Share one OpenMP runtime between torch and Numba (``shared/openmp.py``) and set how its idle
    threads wait (this module's rule); returns what was done, for the log. Call before anything
    imports torch or Numba (the executor's command does, first thing); later calls return the
    first one's answer."""
    global _openmp, _spinning
    if _openmp is not None:
        return _openmp
    set_thread_env()
    given = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    if not given:  # libgomp reads it once, as it loads: before share_runtime loads it
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    runtime = share_runtime()
    if given:
        waiting = "as the environment says: " + ", ".join(f"{k}={v}" for k, v in given.items())
    elif runtime.shared:
        waiting = f"GOMP_SPINCOUNT={SPIN_COUNT} (spin, then sleep)"
    else:  # torch's runtime and Numba's apart: sleep at once
        del os.environ["GOMP_SPINCOUNT"]
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        waiting = "OMP_WAIT_POLICY=PASSIVE (sleep at once)"
    _spinning = runtime.shared and _spins(os.environ)
    _openmp = f"{'one runtime' if runtime.shared else 'separate runtimes'} ({runtime.reason}); {waiting}"
    return _openmp


def configure_cpu_threads(num_threads: int | None, colocated: bool = True) -> ThreadChoice:
    """Give torch and Numba one OpenMP runtime, the same pool size (``choose_threads``) and the
    waiting of this module's rule; returns the choice. Call before torch or Numba is imported."""
    openmp = prepare_openmp()
    import torch

    choice = choose_threads(num_threads, colocated)
    choice = dataclasses.replace(choice, openmp=openmp)
    n = choice.num_threads
    torch.set_num_threads(n)
    try:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    return choice
