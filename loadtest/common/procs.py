"""A process's children and their memory, read from /proc: what the soak and the fault tests use to
find (and kill) the processes ``pagedserve serve`` started, and what the benchmarks report as memory."""

from __future__ import annotations

import os


def child_argvs(pid: int) -> dict[int, list[str]]:
    """Each live child of ``pid``: child pid -> its command line (arguments as strings). Processes
    that end while /proc is read are left out."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue
        found[int(entry)] = argv
    return found


def tree_pss_mib(pid: int) -> float:
    """Proportional set size of ``pid`` and all its descendants, in MiB: pages shared between them
    (the KV pool's shared memory, a mapped weights file) counted once in all, not once per process as
    summed RSS would. Processes that end while /proc is read are left out."""
    total_kib, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(child_argvs(p))
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total_kib += next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration, ValueError):
            continue
    return total_kib / 1024
