"""Which torch device a rank runs on: ``--device auto|cpu|cuda|cuda:N``.

``auto`` is ``cuda`` where torch sees a GPU, else the CPU. ``cuda`` puts the process of device index
``k`` on GPU ``k % count``, where ``k`` is ``--device-index``: serve gives each executor rank its
place among this host's ranks of every replica (``-tp`` rank ``r`` of replica ``i`` on a host of
``n`` ranks per replica: ``i * n + r``), an executor started alone defaults to its ``--rank``. More
ranks than GPUs share them, which the CUDA IPC all-reduce allows (NCCL, ``--all-reduce torch``,
does not). ``cuda:N`` puts every rank on GPU ``N``. The name is checked without torch (the flags'
checks run before torch is imported); the resolution imports it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")


def check_device_name(name: str) -> None:
    if name in DEVICE_CHOICES[:3] or re.fullmatch(r"cuda:\d+", name):
        return
    raise ValueError(f"--device must be {', '.join(DEVICE_CHOICES[:-1])} or {DEVICE_CHOICES[-1]}; got {name!r}")


def resolve_device(name: str, index: int = 0) -> "torch.device":
    """The device ``name`` means for the process of device index ``index``; ``ValueError`` (one line)
    where it names a GPU that torch does not see."""
    check_device_name(name)
    import torch

    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch {torch.__version__} sees no CUDA device"
                         + ("" if torch.version.cuda else " (this torch is a CPU-only build)"))
    count = torch.cuda.device_count()
    if name.startswith("cuda:"):
        gpu = int(name.removeprefix("cuda:"))
        if gpu >= count:
            raise ValueError(f"--device {name}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    else:
        gpu = index % count
    return torch.device("cuda", gpu)


def device_summary(device: "torch.device") -> dict:
    """What to log about ``device``: the GPU's name, memory and compute capability."""
    if device.type != "cuda":
        return {"device": str(device)}
    import torch

    props = torch.cuda.get_device_properties(device)
    return {"device": str(device), "gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "compute_capability": f"{props.major}.{props.minor}", "torch_cuda": torch.version.cuda}
