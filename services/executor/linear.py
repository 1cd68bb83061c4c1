"""The model's matmuls on CPUs (``--linear-kernel``): each ``nn.Linear`` weight reordered once at
load into a layout made for the kernel that multiplies it, oneDNN's or our Numba one.

``nn.functional.linear`` re-reads the weight in its plain row-major layout at every call. oneDNN
(torch's ``mkldnn`` ops, the path ``torch.compile`` takes on CPUs with frozen weights, and what
vLLM-CPU's own linear layers use) multiplies from a weight packed for the machine's vector units.
Measured on this project's 2-core AMD EPYC (Zen 5, AVX-512 BF16), one process, SmolLM2's shapes:
float32 at 16 rows 0.24-0.43x the time of ``F.linear`` (the LM head ``[16, 576] x [576, 49152]``
14.6 -> 3.5 ms), at 64 rows 0.33-0.48x; bfloat16 0.66-0.84x. Results differ from ``F.linear`` by
float32 rounding only (another summation order).

- ``auto`` (the default): in bfloat16 on a CPU with AVX-512 BF16 and no AMX (AMD Zen 4/5), the
  Numba kernel (``kernels/cpu/matmul.py``: at the few rows of a decode step it reads the weights
  at up to the memory's speed, where oneDNN's kernel there took 1.3-1.6x as long; from about 32
  rows both run at the CPU's ``vdpbf16ps`` rate); in bfloat16 elsewhere (AMX, where oneDNN
  multiplies on tiles; AVX2) oneDNN; ``F.linear`` in float32 (the mode whose greedy output equals
  ``transformers`` token for token: ``F.linear`` is the kernel transformers multiplies with, so
  every sum is the same, where oneDNN's other order can flip a near-tie; a tiny random model's n = 3
  greedy samples did in one test run), float16 and on GPUs.
- ``onednn``: required, also in float32 (about 1.7x the float32 throughput here, not bit-identical
  to transformers); an error where it cannot run. ``numba``: required (bfloat16 on a CPU; on a
  CPU without AVX-512 BF16 the kernel widens the pairs to float32 instead: correct, not fast).
  ``torch``: ``F.linear`` always.
- The packed weight replaces the plain one (no second copy); a tied LM head gets its own packed
  copy, the embedding table stays for the lookups. Neither kernel's results depend on the thread
  count.
"""

from __future__ import annotations

import torch
from torch import nn

from .module import Module

LINEAR_KERNELS = ("auto", "onednn", "numba", "torch")
BATCH_HINT = 64  # rows the packing is tuned for (a decode batch); every row count works


class PackedLinear(Module):
    """``nn.Linear``'s forward over a oneDNN-packed copy of its weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PairLinear(Module):
    """``nn.Linear``'s forward in bfloat16 through the Numba kernel (``kernels/cpu/matmul.py``), on a
    copy of its weight packed in input pairs."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from kernels.cpu.matmul import pack_pairs, pad_bias

        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_pairs(linear.weight.detach())
        self.bias = pad_bias(linear.bias, self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.cpu.matmul import matmul_bf16

        return matmul_bf16(x, self.packed, self.out_features, self.bias)


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def check_linear_kernel(kernel: str) -> None:
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"--linear-kernel must be one of {', '.join(LINEAR_KERNELS)}, got {kernel!r}")


def numba_preferred(features=None) -> bool:
    """Whether ``auto`` multiplies bfloat16 with the Numba kernel here: the CPU has AVX-512 BF16 but
    no AMX tiles (``shared/cpu_features.py``) and numba compiles for AVX-512 BF16 (the kernel's
    ``vdpbf16ps``). ``features``: a ``CpuFeatures`` (tests), else this machine's."""
    from shared.cpu_features import read_cpu_features

    features = features or read_cpu_features()
    if features.native_bf16() != "avx512_bf16":
        return False
    from kernels.cpu.vectors import DOT_BF16

    return DOT_BF16


def choose_linear_kernel(kernel: str, device: torch.device, dtype: torch.dtype, features=None) -> str:
    """What ``--linear-kernel kernel`` multiplies with for this device and dtype: ``"onednn"``,
    ``"numba"`` or ``"torch"`` (``F.linear``); raises ValueError where a required one cannot run."""
    check_linear_kernel(kernel)
    if kernel == "numba":
        if device.type != "cpu" or dtype != torch.bfloat16:
            raise ValueError(f"--linear-kernel numba needs a CPU and bfloat16; got {device.type} and {dtype}")
        return "numba"
    supported = onednn_supported(device, dtype)
    if kernel == "onednn":
        if not supported:
            raise ValueError(f"--linear-kernel onednn needs a CPU with torch's oneDNN and float32 or bfloat16; "
                             f"got {device.type} and {dtype}")
        return "onednn"
    if kernel == "torch" or device.type != "cpu" or dtype != torch.bfloat16:
        return "torch"
    if numba_preferred(features):
        return "numba"
    return "onednn" if supported else "torch"


def pack_linears(model: nn.Module, kind: str = "onednn") -> int:
    """Replace every ``nn.Linear`` in ``model`` by a ``PackedLinear`` (``kind`` "onednn") or a
    ``PairLinear`` ("numba"; a layer with an odd number of inputs, which its pairs cannot hold,
    stays an ``nn.Linear``); returns how many were replaced."""
    wrap = {"onednn": PackedLinear, "numba": PairLinear}[kind]
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)
               and (kind != "numba" or child.in_features % 2 == 0)]
    for parent, name, child in targets:
        setattr(parent, name, wrap(child))
    return len(targets)


def linear_kernel_name(model: nn.Module) -> str:
    """Which kernel the model's matmuls run on, for the log."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            return "onednn"
        if isinstance(m, PairLinear):
            return "numba"
    return "torch"
