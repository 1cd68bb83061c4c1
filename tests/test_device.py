"""``--device``: the names it takes, and what they resolve to on a machine without a GPU (the CUDA
path itself runs on a GPU only: ``loadtest/gpu_check.sh``)."""

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
    assert resolve_device("cpu", rank=3) == torch.device("cpu")
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
    assert [resolve_device("cuda", rank).index for rank in range(3)] == [r % count for r in range(3)]
    assert resolve_device("cuda:0", rank=2) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=f"torch sees {count} CUDA device"):
        resolve_device(f"cuda:{count}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is seen")
def test_an_attention_backend_asked_for_by_name_that_cannot_run_is_a_flag_error():
    """``--attention-backend cuda`` without a GPU: a ValueError naming the flag (the executor exits
    2, no restarts); ``auto`` falls back to the PyTorch reference there."""
    from services.executor.attention import select_backend

    with pytest.raises(ValueError, match=r"^--attention-backend cuda: .*no CUDA device"):
        select_backend("cuda", torch.device("cpu"))
    assert select_backend("auto", torch.device("cuda")).name == "torch"


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
