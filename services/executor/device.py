"""Which torch device a rank runs on: ``--device auto|cpu|cuda|cuda:N``.

``auto`` is the first CUDA device torch sees, else the CPU. ``cuda`` puts rank ``r`` of a group on
GPU ``r % device_count`` (a group of more ranks than GPUs shares them, which the CUDA IPC all-reduce
allows); ``cuda:N`` puts every rank on GPU ``N``. The name is checked without torch (the flags'
checks run before torch is imported); the resolution imports it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")


def check_device_name(name: str) -> None:
    if name in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", name):
        return
    raise ValueError(f"--device must be auto, cpu, cuda or cuda:N; got {name!r}")


def resolve_device(name: str, rank: int = 0) -> "torch.device":
    """The device ``name`` means for ``rank``; ``ValueError`` (one line) where it names a GPU that
    torch does not see."""
    check_device_name(name)
    import torch

    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch {torch.__version__} sees no CUDA device"
                         + ("" if torch.version.cuda else " (this torch is a CPU-only build)"))
    count = torch.cuda.device_count()
    if name.startswith("cuda:"):
        index = int(name.removeprefix("cuda:"))
        if index >= count:
            raise ValueError(f"--device {name}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    else:
        index = rank % count
    return torch.device("cuda", index)


def device_summary(device: "torch.device") -> dict:
    """What to log about ``device``: the GPU's name, memory and compute capability."""
    if device.type != "cuda":
        return {"device": str(device)}
    import torch

    props = torch.cuda.get_device_properties(device)
    return {"device": str(device), "gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "compute_capability": f"{props.major}.{props.minor}", "torch_cuda": torch.version.cuda}
