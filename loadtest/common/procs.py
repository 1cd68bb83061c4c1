"""A process's children, read from /proc: what the soak and the fault tests use to find (and kill)
the processes ``pagedserve serve`` started."""

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
