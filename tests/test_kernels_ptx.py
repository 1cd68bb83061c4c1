"""Every Numba CUDA kernel compiles to PTX for sm_90 (H100/H200), without a GPU.

``numba.cuda.compile_ptx`` needs NVVM (``libnvvm.so``) and libdevice from a CUDA toolkit (found
through ``CUDA_HOME`` / ``CUDA_PATH``, ``/usr/local/cuda``, or the ``nvidia-*`` pip wheels), not a
driver; the module skips, saying why, when they are missing. It cannot run under the CUDA
simulator (no compiler there), so it runs in the normal pytest invocation.
"""

from __future__ import annotations

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


@pytest.mark.parametrize("name", sorted(kcuda.ptx_signatures()))
def test_kernel_compiles_to_ptx_for_sm90(name):
    fn, sig = kcuda.ptx_signatures()[name]
    ptx, _ = cuda.compile_ptx(fn.py_func, sig, cc=CC)
    assert ".target sm_90" in ptx
    assert ".f64" not in ptx  # float32 throughout: no double-precision arithmetic slipped in
    if name in ("decode_kernel", "prefill_kernel"):
        assert "shfl.sync.bfly" in ptx  # warp-shuffle reductions on a real GPU
        assert "bar.sync" in ptx


@pytest.mark.parametrize("name", ["decode_kernel", "prefill_kernel"])
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
