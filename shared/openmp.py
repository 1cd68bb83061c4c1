"""One OpenMP runtime for torch and Numba in the executor, so that its idle threads may spin.

torch's wheel bundles GNU OpenMP (``torch/lib/libgomp.so.1``) and Numba's ``omp`` threading layer
links the system's (its ``omppool`` extension names ``libgomp.so.1.0.0`` or the like). Loaded as
they come, a process holds two runtimes, each with its own pool of worker threads on the same
cores, and every decoder layer alternates between them (matmuls in torch's, attention, norms and
rotary in Numba's). Between two parallel regions an idle worker either sleeps
(``OMP_WAIT_POLICY=PASSIVE``: the next region pays a futex wake-up per worker) or spins (libgomp's
default): with two pools a spinning worker of one holds the core that a worker of the other now
needs, until the kernel preempts it (``shared/cpu_threads.py`` measured steps 2 to 16 times slower).

With one runtime the worker that spins is the one the next region runs on. ``share_runtime`` loads,
before torch or Numba, the very library Numba's layer names (read from that extension's ELF
``DT_NEEDED``), globally: Numba then finds it loaded under its name, and torch's libraries, which
ask for the soname ``libgomp.so.1``, are matched to it by soname (glibc's loader reuses a loaded
object whose ``DT_SONAME`` equals the name asked for). torch needs only ``GOMP_1.0``, ``GOMP_4.0``
and ``OMP_1.0`` of it, which every libgomp since GCC 4.9 has. ``loaded_runtimes`` reads
``/proc/self/maps`` to say how many runtimes a process ended up with.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import struct
import sys
from dataclasses import dataclass

_SHT_DYNAMIC = 6
_DT_NULL, _DT_NEEDED = 0, 1
# file names of OpenMP runtimes as they appear in /proc/self/maps
_RUNTIME_PREFIXES = ("libgomp", "libiomp", "libomp")


def elf_needed(path: str) -> list[str]:
    """The ``DT_NEEDED`` entries of a 64-bit little-endian ELF shared object (the libraries it
    names); [] for any other file or one that cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        base = shoff + i * shentsize
        if base + 64 > len(data):
            return []
        _, sh_type, _, _, offset, size, link = struct.unpack_from("<IIQQQQI", data, base)
        sections.append((sh_type, offset, size, link))
    names = []
    for sh_type, offset, size, link in sections:
        if sh_type != _SHT_DYNAMIC or link >= len(sections):
            continue
        strtab = sections[link][1]
        for entry in range(offset, min(offset + size, len(data) - 15), 16):
            tag, value = struct.unpack_from("<qQ", data, entry)
            if tag == _DT_NULL:
                break
            if tag == _DT_NEEDED:
                end = data.find(b"\0", strtab + value)
                names.append(data[strtab + value:end].decode("utf-8", "replace"))
    return names


def numba_runtime_name() -> str | None:
    """The OpenMP library Numba's ``omp`` threading layer links (as its extension names it), or
    None without Numba or that layer. Finds the files without importing Numba."""
    spec = importlib.util.find_spec("numba")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        for path in sorted(glob.glob(os.path.join(location, "np", "ufunc", "omppool*"))):
            for name in elf_needed(path):
                if name.startswith("libgomp"):
                    return name
    return None


@dataclass(frozen=True)
class SharedRuntime:
    shared: bool  # one runtime for torch and Numba (loaded here, before either)
    reason: str


def share_runtime() -> SharedRuntime:
    """Load Numba's OpenMP runtime globally so that torch uses it too. Call before torch or Numba
    is imported (after, it changes nothing and says so). Also pins Numba's threading layer to
    ``omp`` (which would otherwise prefer TBB where the ``tbb`` package is installed), unless the
    environment chose one."""
    if os.environ.get("PAGEDSERVE_SHARE_OPENMP", "1") == "0":
        return SharedRuntime(False, "PAGEDSERVE_SHARE_OPENMP=0")
    if "torch" in sys.modules or "numba" in sys.modules:
        return SharedRuntime(False, "torch or numba was imported first")
    layer = os.environ.get("NUMBA_THREADING_LAYER", "default")
    if layer not in ("default", "omp"):
        return SharedRuntime(False, f"NUMBA_THREADING_LAYER={layer}")
    name = numba_runtime_name()
    if name is None:
        return SharedRuntime(False, "numba has no OpenMP threading layer here")
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        return SharedRuntime(False, f"{name} did not load: {e}")
    os.environ["NUMBA_THREADING_LAYER"] = "omp"
    return SharedRuntime(True, f"numba's {name}, loaded before torch")


def loaded_runtimes(maps: str = "/proc/self/maps") -> list[str]:
    """The distinct OpenMP runtime files mapped into this process (by device and inode: a symlink
    and its target count once)."""
    seen: dict[tuple[int, int], str] = {}
    try:
        with open(maps) as f:
            lines = f.readlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if not os.path.basename(path).startswith(_RUNTIME_PREFIXES):
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        seen.setdefault((st.st_dev, st.st_ino), path)
    return sorted(seen.values())
