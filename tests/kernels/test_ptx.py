"""Every Numba CUDA kernel compiles to PTX for sm_90 (H100/H200), and ``ptxas`` assembles it for
sm_80 and sm_90 without spills and, for decode, at 50% occupancy or more; without a GPU.

``numba.cuda.compile_ptx`` needs NVVM (``libnvvm.so``) and libdevice from a CUDA toolkit (found
through ``CUDA_HOME`` / ``CUDA_PATH``, ``/usr/local/cuda``, or the ``nvidia-*`` pip wheels), not a
driver; the module skips, saying why, when they are missing. ``ptxas`` comes from the
``nvidia-cuda-nvcc`` wheel of the test extras (``kernels/cuda/resources.py``); only the tests that
assemble skip, saying so, when it cannot be found. Nothing here runs under the CUDA simulator (no
compiler there), so it runs in the normal pytest invocation.
"""

from __future__ import annotations

import re
import sys

import numba
import pytest

if numba.config.ENABLE_CUDASIM:
    pytest.skip("PTX compilation is unavailable under NUMBA_ENABLE_CUDASIM=1", allow_module_level=True)

from numba import cuda  # noqa: E402

from kernels import cuda as kcuda  # noqa: E402

CC = (9, 0)


def _probe_kernel(a):
    i = cuda.grid(1)
    if i < a.shape[0]:
        a[i] += 1


def _compiler_missing() -> str | None:
    try:
        cuda.compile_ptx(_probe_kernel, (numba.float32[::1],), cc=CC)
    except Exception as exc:  # NvvmSupportError, missing libdevice, CudaSupportError...
        return f"no CUDA compiler for numba (NVVM/libdevice): {type(exc).__name__}: {exc}"
    return None


_MISSING = _compiler_missing()
if _MISSING:
    pytest.skip(_MISSING.splitlines()[0], allow_module_level=True)


# the fast loop compiles the float32 kernels; their 16-bit variants only in the whole suite
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.endswith(("_bf16", "_f16")) else n
                                  for n in sorted(kcuda.ptx_signatures())])
def test_kernel_compiles_to_ptx_for_sm90(name):
    fn, sig = kcuda.ptx_signatures()[name]
    ptx, _ = cuda.compile_ptx(fn.py_func, sig, cc=CC)
    assert ".target sm_90" in ptx
    assert ".f64" not in ptx  # float32 throughout: no double-precision arithmetic slipped in
    if name.startswith(("decode_kernel", "prefill_kernel")):
        assert "shfl.sync.bfly" in ptx  # warp-shuffle reductions on a real GPU
        assert "bar.sync" in ptx
    widened = not name.startswith("write")  # the cache write moves the bits as they are
    # bfloat16 bits widened by a 16-bit shift into a float32 (none in the float32 kernels), float16
    # by the conversion instruction
    assert bool(re.search(r"shl\.b32\s+%r\d+, %r\d+, 16;", ptx)) == (widened and name.endswith("_bf16"))
    assert ("cvt.f32.f16" in ptx) == (widened and name.endswith("_f16"))


@pytest.mark.parametrize("name", ["decode_kernel", pytest.param("prefill_kernel", marks=pytest.mark.slow)])
def test_shared_memory_reduction_variant_compiles(name, monkeypatch):
    """The simulator's variant (shared-memory reductions) is valid CUDA too."""
    fn, sig = kcuda.ptx_signatures()[name]
    # a kernel reads the constants from its own module's globals when it is compiled
    module = sys.modules[fn.py_func.__module__]
    monkeypatch.setattr(module, "USE_SHUFFLE", False)
    monkeypatch.setattr(module, "PARTIALS", kcuda.THREADS * kcuda.WARP)
    ptx, _ = cuda.compile_ptx(fn.py_func, sig, cc=CC)
    assert "shfl.sync" not in ptx
    assert ".f64" not in ptx


# ---- ptxas: the PTX assembled for sm_80 and sm_90, its resources and the occupancy they allow ----

from kernels.cuda import resources  # noqa: E402

_PTXAS = resources.find_ptxas()
needs_ptxas = pytest.mark.skipif(
    _PTXAS is None, reason="no ptxas: pip install nvidia-cuda-nvcc (pagedserve's test extras)")


@pytest.mark.parametrize("registers,threads,shared,blocks,fraction,limiter", [
    (64, 128, 3584, 8, 0.5, "registers"),  # 2,048 registers per warp: 32 warps
    (80, 128, 3584, 6, 0.375, "registers"),  # 2,560 per warp: 25 warps, 6 whole blocks
    (55, 128, 3584, 9, 0.5625, "registers"),  # 1,760 -> 1,792 per warp: 36 warps
    (32, 256, 0, 8, 1.0, "warps"),
    (16, 32, 0, 32, 0.5, "blocks"),  # one-warp blocks: the 32-block cap
    (32, 128, 40 * 1024, 5, 0.3125, "shared memory"),  # sm_90: 228 KiB / (40 + 1) KiB
])
def test_occupancy_arithmetic(registers, threads, shared, blocks, fraction, limiter):
    occ = resources.occupancy((9, 0), registers, threads, shared)
    assert (occ.blocks_per_sm, occ.fraction, occ.limiter) == (blocks, fraction, limiter)
    # shared memory per SM: 164 KiB on sm_80, 228 KiB on sm_90; blocks of 48 (+ 1 reserved) KiB
    assert resources.occupancy((8, 0), 32, 128, 48 * 1024).blocks_per_sm == 3
    assert resources.occupancy((9, 0), 32, 128, 48 * 1024).blocks_per_sm == 4


@pytest.mark.slow  # assembles every kernel with ptxas
@needs_ptxas
def test_ptxas_assembles_every_kernel_without_spills():
    """Every kernel assembles for sm_80 and sm_90 under its own register cap, spills nothing, and
    decode keeps at least half the SM's warps resident at the launch configuration used."""
    found = resources.kernel_resources(_PTXAS)
    assert {(r.name, r.cc) for r in found} == {
        (name, cc) for name in kcuda.ptx_signatures() for cc in resources.ARCHS}
    for r in found:
        assert r.registers > 0 and r.threads == kcuda.THREADS, r
        assert r.spill_stores == 0 and r.spill_loads == 0, r
        assert r.stack_bytes == 0, r
        if r.name.startswith(("decode_kernel", "prefill_kernel")):
            assert r.max_registers == kcuda.ATTENTION_MAX_REGISTERS, r
            assert r.shared_bytes >= 4 * (kcuda.MAX_HEAD_DIM + kcuda.MAX_PARTITION), r
        occ = resources.occupancy(r.cc, r.registers, r.threads, r.shared_bytes)
        if r.name.startswith("decode_kernel"):
            assert occ.fraction >= 0.5, (r, occ)


@pytest.mark.slow  # assembles every kernel with ptxas
@needs_ptxas
def test_bench_ptxas_prints_the_table(capsys):
    from loadtest.kernels import attention as bench

    assert bench.main(["--ptxas"]) == 0
    out = capsys.readouterr().out
    rows = out.splitlines()
    assert sum(row.startswith("decode_kernel ") for row in rows) == 2 and "sm_80" in out and "sm_90" in out
    assert sum(row.startswith("decode_kernel_bf16 ") for row in rows) == 2
    assert "requirement (no spills; decode occupancy >= 50%): met" in out
