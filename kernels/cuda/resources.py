"""What each Numba CUDA kernel costs a streaming multiprocessor, from ``ptxas``, without a GPU.

``cuda.compile_ptx`` gives each kernel's PTX (``ptx_signatures``); ``ptxas -v`` assembles it for
sm_80 (A100) and sm_90 (H100/H200) with the register cap numba hands the driver's linker for that
kernel (``max_registers`` -> ``--maxrregcount``) and reports registers per thread, spills, stack
and static shared memory. From those and the launch configuration (``THREADS`` threads per block,
no dynamic shared memory: ``kernels/cuda/launch.py``) ``occupancy`` computes the resident warps per
SM the way the CUDA Occupancy Calculator does, with the per-SM limits of the CUDA C++ Programming
Guide ("Technical Specifications per Compute Capability"):

| limit | sm_80 | sm_90 |
|---|---|---|
| warps per SM | 64 | 64 |
| blocks per SM | 32 | 32 |
| 32-bit registers per SM | 65,536 | 65,536 |
| register allocation | per warp, in units of 256 | same |
| shared memory per SM | 164 KiB | 228 KiB |
| shared memory reserved per block | 1 KiB | 1 KiB |
| shared memory allocation unit | 128 bytes | 128 bytes |

``ptxas`` comes from PyPI's ``nvidia-cuda-nvcc`` (the test extras), else from ``PATH`` or
``CUDA_HOME``. The driver's JIT assembles the same PTX on a real GPU; its version may differ from
this ``ptxas``, so the figures are what the kernels need, not a measurement on a device.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

ARCHS = ((8, 0), (9, 0))
_SM_LIMITS = {  # cc -> (warps, blocks, registers, shared bytes) per SM
    (8, 0): (64, 32, 65536, 164 * 1024),
    (9, 0): (64, 32, 65536, 228 * 1024),
}
_REG_UNIT, _SHARED_RESERVED, _SHARED_UNIT = 256, 1024, 128


@dataclass(frozen=True)
class KernelResources:
    name: str
    cc: tuple[int, int]
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_bytes: int
    shared_bytes: int  # static shared memory per block
    max_registers: int | None  # the cap it was assembled under
    threads: int  # per block, at launch


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    warps_per_sm: int
    fraction: float  # resident warps / the SM's maximum
    limiter: str  # "registers", "shared memory", "warps" or "blocks"


def occupancy(cc: tuple[int, int], registers: int, threads: int, shared_bytes: int) -> Occupancy:
    """Resident blocks and warps per SM for a kernel using ``registers`` per thread and
    ``shared_bytes`` of shared memory per block, launched with ``threads`` per block."""
    max_warps, max_blocks, sm_registers, sm_shared = _SM_LIMITS[cc]
    warps = -(-threads // 32)
    regs_per_warp = -(-registers * 32 // _REG_UNIT) * _REG_UNIT
    shared = -(-(shared_bytes + _SHARED_RESERVED) // _SHARED_UNIT) * _SHARED_UNIT
    limits = {  # on a tie the hardware's fixed caps are named first
        "warps": max_warps // warps,
        "blocks": max_blocks,
        "registers": (sm_registers // regs_per_warp) // warps if registers else max_blocks,
        "shared memory": sm_shared // shared,
    }
    limiter = min(limits, key=limits.get)
    blocks = limits[limiter]
    return Occupancy(blocks, blocks * warps, blocks * warps / max_warps, limiter)


def find_ptxas() -> str | None:
    """``ptxas`` from the ``nvidia-cuda-nvcc`` wheel, else from PATH, else from CUDA_HOME."""
    try:
        import nvidia  # namespace package of NVIDIA's wheels

        for root in nvidia.__path__:
            # CUDA 13 wheels: nvidia/cu13/bin; CUDA 12 wheels: nvidia/cuda_nvcc/bin
            for path in sorted(glob.glob(os.path.join(root, "*", "bin", "ptxas")), reverse=True):
                if os.access(path, os.X_OK):
                    return path
    except ImportError:
        pass
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found = shutil.which("ptxas") or os.path.join(home, "bin", "ptxas")
    return found if os.access(found, os.X_OK) else None


def _field(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    return int(match.group(1)) if match else 0


def assemble(name: str, ptx: str, cc: tuple[int, int], ptxas: str, threads: int,
             max_registers: int | None = None) -> KernelResources:
    """Assemble ``ptx`` for ``cc`` and read ``ptxas -v``'s report of its one entry function."""
    with tempfile.TemporaryDirectory(prefix="pagedserve-ptxas-") as tmp:
        src = os.path.join(tmp, f"{name}.ptx")
        with open(src, "w", encoding="utf-8") as f:
            f.write(ptx)
        cmd = [ptxas, f"--gpu-name=sm_{cc[0]}{cc[1]}", "--verbose", "-o", src + ".cubin", src]
        if max_registers:
            cmd.insert(1, f"--maxrregcount={max_registers}")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed on {name} for sm_{cc[0]}{cc[1]} (exit "
                           f"{done.returncode}): {done.stderr.strip()[-2000:]}")
    report = done.stderr + done.stdout
    if "Used " not in report:
        raise RuntimeError(f"ptxas gave no resource report for {name}: {report[-2000:]}")
    return KernelResources(
        name, cc, _field(r"Used (\d+) registers", report),
        _field(r"(\d+) bytes spill stores", report), _field(r"(\d+) bytes spill loads", report),
        _field(r"(\d+) bytes stack frame", report), _field(r"(\d+) bytes smem", report),
        max_registers, threads)


def kernel_resources(ptxas: str, archs=ARCHS) -> list[KernelResources]:
    """Every kernel of ``ptx_signatures`` assembled for every arch in ``archs``."""
    from numba import cuda

    from kernels.cuda.config import THREADS
    from kernels.cuda.ptx import ptx_signatures

    out = []
    for name, (kernel, signature) in sorted(ptx_signatures().items()):
        cap = kernel.targetoptions.get("max_registers")
        for cc in archs:
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=cc)
            out.append(assemble(name, ptx, cc, ptxas, THREADS, cap))
    return out


def main() -> int:
    """Print the table (``python -m loadtest.kernels.attention --ptxas``); 1 when a kernel spills or decode's
    occupancy is under 50%, 2 when there is no ptxas."""
    ptxas = find_ptxas()
    if ptxas is None:
        print("no ptxas: pip install nvidia-cuda-nvcc (pagedserve's test extras), or put a CUDA "
              "toolkit's bin/ on PATH")
        return 2
    print(f"ptxas: {ptxas}")
    print(f"{'kernel':<20} {'arch':<6} {'threads':>7} {'regs':>4} {'cap':>4} {'spill st/ld':>11} "
          f"{'stack':>5} {'smem':>6} | {'blocks/SM':>9} {'occupancy':>9}  limited by")
    missed = False
    for r in kernel_resources(ptxas):
        occ = occupancy(r.cc, r.registers, r.threads, r.shared_bytes)
        bad = r.spill_stores or r.spill_loads or (r.name.startswith("decode_kernel") and occ.fraction < 0.5)
        missed = missed or bool(bad)
        print(f"{r.name:<20} sm_{r.cc[0]}{r.cc[1]:<3} {r.threads:>7} {r.registers:>4} "
              f"{r.max_registers or '-':>4} {f'{r.spill_stores}/{r.spill_loads}':>11} "
              f"{r.stack_bytes:>5} {r.shared_bytes:>6} | {occ.blocks_per_sm:>9} "
              f"{occ.fraction:>8.0%}  {occ.limiter}{'   <- MISSES' if bad else ''}")
    print("requirement (no spills; decode occupancy >= 50%):", "missed" if missed else "met")
    return 1 if missed else 0
