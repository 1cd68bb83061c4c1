"""CPU thread pools: torch's OpenMP pool and Numba's pool must not spin against each other.

Measured here (2 cores, SmolLM2 decode, frontend and scheduler running beside the executor):
torch's default OpenMP threads busy-wait after each parallel region, and with another process
on the other core a decode step took 5 to 12 times longer than with one thread. Passive waiting
removes the spin; we set ``OMP_WAIT_POLICY=PASSIVE`` before torch is imported and give torch and
Numba the same thread count (default: all cores, see ``loadtest/threads.py`` for the figures).
"""

from __future__ import annotations

import os


def set_thread_env() -> None:
    """Call before importing torch or numba (the OpenMP runtime reads these once)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("KMP_BLOCKTIME", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def configure_cpu_threads(num_threads: int | None) -> int:
    """Give torch and Numba the same pool size; returns it."""
    set_thread_env()
    import torch

    n = num_threads or int(os.environ.get("PAGEDSERVE_NUM_THREADS", 0)) or (os.cpu_count() or 1)
    torch.set_num_threads(n)
    try:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except ImportError:
        pass
    return n
