"""``--device``: the names it takes, and what they resolve to on a machine without a GPU (the CUDA
path itself runs on a GPU only: ``loadtest/gpu/gpu_check.sh``)."""

from __future__ import annotations

import pytest
import torch

from services.executor.device import check_device_name, device_summary, resolve_device
from services.executor.loader import RunnerOptions


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_names_taken(name):
    check_device_name(name)
    assert RunnerOptions(device=name).device == name


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "mps", "", "cpu:0"])
def test_names_refused(name):
    with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:N"):
        check_device_name(name)
    with pytest.raises(ValueError, match="--device must be"):
        RunnerOptions(device=name)


def test_cpu_and_auto_resolve_to_the_cpu_without_a_gpu():
    assert resolve_device("cpu", index=3) == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
        return
    assert resolve_device("auto") == torch.device("cpu")
    assert device_summary(torch.device("cpu")) == {"device": "cpu"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is seen")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_a_gpu_that_is_not_there_is_refused_in_one_line(name):
    with pytest.raises(ValueError, match=rf"^--device {name}: torch \S+ sees no CUDA device") as info:
        resolve_device(name)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ranks_spread_over_the_gpus():
    count = torch.cuda.device_count()
    assert [resolve_device("cuda", index).index for index in range(3)] == [i % count for i in range(3)]
    assert resolve_device("cuda:0", index=2) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=f"torch sees {count} CUDA device"):
        resolve_device(f"cuda:{count}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is seen")
def test_an_attention_backend_asked_for_by_name_that_cannot_run_is_a_flag_error():
    """``--attention-backend cuda`` without a GPU: a ValueError naming the flag (the executor exits
    2, no restarts); ``auto`` falls back to the PyTorch reference there."""
    from services.executor.attention import select_backend

    with pytest.raises(ValueError, match=r"^--attention-backend cuda: .*no CUDA device"):
        select_backend("cuda", torch.device("cuda"))
    assert select_backend("auto", torch.device("cuda")).name == "torch"


def test_a_backend_on_the_wrong_device_is_a_flag_error():
    """The CPU kernels on a GPU's tensors, or the GPU kernels on the CPU's, would fall back to the
    PyTorch reference on every call: refused at start instead."""
    from services.executor.attention import select_backend

    with pytest.raises(ValueError, match=r"^--attention-backend cuda runs on a GPU, not on --device cpu; use numba"):
        select_backend("cuda", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^--attention-backend numba runs on the CPU, not on --device cuda:0; use cuda"):
        select_backend("numba", torch.device("cuda", 0))
    assert select_backend("torch", torch.device("cuda", 0)).name == "torch"  # the reference runs anywhere


def test_a_numba_cuda_that_cannot_load_is_refused_before_the_first_kernel(monkeypatch):
    """numba-cuda 0.30.4 fails every compile under numpy 2.5 (``np.row_stack``): the backend checks
    that numba's CUDA lowering loads when it is made, not at the first launch."""
    import sys

    from kernels.cuda import backend

    def broken(*args, **kwargs):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    monkeypatch.delitem(sys.modules, "numba.cuda.cudaimpl", raising=False)
    monkeypatch.setattr("builtins.__import__", _failing_import("numba.cuda.cudaimpl", broken))
    with pytest.raises(ImportError, match=r"cannot compile kernels with numpy .*row_stack.*install numpy<2\.5"):
        backend._check_numba_cuda_loads()


def _failing_import(name, fail):
    import builtins

    real = builtins.__import__

    def fake(module, *args, **kwargs):
        if module == name:
            fail()
        return real(module, *args, **kwargs)

    return fake


def test_running_out_of_gpu_memory_at_start_is_a_configuration_error():
    """The executor turns a GPU's OutOfMemoryError while loading or warming up into a one-line
    ValueError (exit 2: serve stops and says so, rather than restarting into the same wall)."""
    from services.executor.main import out_of_memory_at_start

    said = "CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has a total capacity of 139 GiB"
    refusal = out_of_memory_at_start(torch.OutOfMemoryError(said))
    assert isinstance(refusal, ValueError) and "\n" not in str(refusal)
    assert "Tried to allocate 2.00 GiB" in str(refusal) and "--kv-cache-memory" in str(refusal)
    assert out_of_memory_at_start(RuntimeError("something else")) is None


def test_auto_dtype_on_a_gpu_without_bfloat16_is_float16(monkeypatch):
    from services.executor.weights import resolve_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_dtype("auto", torch.device("cuda", 0)).dtype == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", torch.device("cuda", 0)).dtype == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda", 0)).dtype == torch.float32


def test_the_gpu_memory_check_takes_the_gpus_free_memory(monkeypatch, tmp_path):
    """``plan_runner`` on a GPU checks the pool against 90% of that GPU's free memory (faked here)."""
    import json

    from services.executor import loader
    from shared.hf_config import ModelCheckError
    from tests.executor.test_memory_plan import TINY, model_dir

    from services.executor.weights import load_hf_config
    from shared.model_source import ModelSource

    hf_config = load_hf_config(ModelSource("tiny", str(model_dir(tmp_path, "tiny", json.dumps(TINY)))))
    monkeypatch.setattr(loader, "resolve_device", lambda name, index=0: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**30, 2**31))
    options = loader.RunnerOptions(device="cuda", dtype=torch.float32, kv_cache_memory="950MiB", swap_space=0)
    with pytest.raises(ModelCheckError, match=r"but cuda:0 \(90% of its free memory\) has 0\.9 GiB available"):
        loader.plan_runner(hf_config, options)
    fits = loader.RunnerOptions(device="cuda", dtype=torch.float32, kv_cache_memory="800MiB", swap_space=0)
    assert loader.plan_runner(hf_config, fits).num_blocks > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is seen")
def test_the_kernel_bench_without_cpu_or_gpu_measures_nothing_and_says_so(capsys):
    from loadtest.kernels import attention as bench

    with pytest.raises(SystemExit) as info:
        bench.main(["--no-cpu"])
    assert info.value.code == 2 and "--no-cpu leaves nothing to measure" in capsys.readouterr().err


@pytest.mark.parametrize("native,spins", [("amx", True), ("avx512_bf16", False), (None, True)])
def test_the_numba_backend_gets_what_shared_reads_of_the_cpu(native, spins, monkeypatch):
    """The executor reads the machine for the CPU kernels (``kernels/`` imports no ``shared``): the
    CPU's native bf16 path (AMX turns on the fused-attention prefill) and whether idle OpenMP threads
    spin, asked again at each ``parallel_small_rows`` call."""
    from services.executor.attention import select_backend

    class Features:
        def native_bf16(self):
            return native

    spinning = [spins]
    monkeypatch.setattr("shared.cpu_features.read_cpu_features", lambda: Features())
    monkeypatch.setattr("shared.cpu_threads.idle_threads_spin", lambda: spinning[0])
    backend = select_backend("numba", torch.device("cpu"))
    assert backend.name == "numba" and backend.matmul_prefill_path is (native == "amx")
    assert backend.parallel_small_rows(True) is spins
    spinning[0] = not spins
    assert backend.parallel_small_rows(True) is (not spins)
    assert backend.parallel_small_rows(False) is False
