"""The model's matmuls on CPUs: each ``nn.Linear`` weight reordered once into oneDNN's blocked
layout at load, then multiplied by oneDNN directly (``--linear-kernel``).

``nn.functional.linear`` re-reads the weight in its plain row-major layout at every call. oneDNN
(torch's ``mkldnn`` ops, the path ``torch.compile`` takes on CPUs with frozen weights, and what
vLLM-CPU's own linear layers use) multiplies from a weight packed for the machine's vector units.
Measured on this project's 2-core AMD EPYC (Zen 5, AVX-512 BF16), one process, SmolLM2's shapes:
float32 at 16 rows 0.24-0.43x the time of ``F.linear`` (the LM head ``[16, 576] x [576, 49152]``
14.6 -> 3.5 ms), at 64 rows 0.33-0.48x; bfloat16 0.66-0.84x. Results differ from ``F.linear`` by
float32 rounding only (another summation order).

- ``auto`` (the default): oneDNN on CPUs where torch has it, in bfloat16; ``F.linear`` in float32
  (the mode whose greedy output equals ``transformers`` token for token: ``F.linear`` is the kernel
  transformers multiplies with, so every sum is the same, where oneDNN's other order can flip a
  near-tie; a tiny random model's n = 3 greedy samples did in one test run), float16 and on GPUs.
  ``onednn``: required, also in float32 (about 1.7x the float32 throughput here, not bit-identical
  to transformers); an error where it cannot run. ``torch``: ``F.linear`` always.
- The packed weight replaces the plain one (no second copy); a tied LM head gets its own packed
  copy, the embedding table stays for the lookups.
"""

from __future__ import annotations

import torch
from torch import nn

LINEAR_KERNELS = ("auto", "onednn", "torch")
BATCH_HINT = 64  # rows the packing is tuned for (a decode batch); every row count works


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-packed copy of its weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def check_linear_kernel(kernel: str) -> None:
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"--linear-kernel must be one of {', '.join(LINEAR_KERNELS)}, got {kernel!r}")


def use_onednn(kernel: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``--linear-kernel kernel`` packs the weights for this device and dtype."""
    check_linear_kernel(kernel)
    supported = onednn_supported(device, dtype)
    if kernel == "onednn" and not supported:
        raise ValueError(f"--linear-kernel onednn needs a CPU with torch's oneDNN and float32 or bfloat16; "
                         f"got {device.type} and {dtype}")
    return kernel == "onednn" or (kernel == "auto" and supported and dtype == torch.bfloat16)


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a ``PackedLinear``; returns how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)


def linear_kernel_name(model: nn.Module) -> str:
    """Which kernel the model's matmuls run on, for the log."""
    return "onednn" if any(isinstance(m, PackedLinear) for m in model.modules()) else "torch"
