"""The model's layers over GGUF-quantized weights (``--quantization gguf`` on a GGUF file): a
``QuantLinear`` for each matmul whose weight the file holds quantized, a ``QuantEmbedding`` reading
the embedding rows from their blocks, and the tied LM head multiplying with the same blocks.

Loading (``install_quantized``, called by ``weights.build_model``): each ``QuantWeight`` is cut to
this rank's share on block boundaries (``shard_quantized``: rows are free, a row-parallel split of
the inputs must fall on a block edge or is refused in one line), fused projections join their
parts' rows (parts of different types stay separate packs, their outputs concatenated), and the
blocks are repacked for the kernels (``kernels/cpu/quant_matmul.py``).
"""

from __future__ import annotations

import numpy as np
import structlog
import torch

from .gguf_weights import QuantWeight
from .model import FUSED_PROJECTIONS, VocabEmbedding
from .module import Module
from .parallel.sharding import _HEAD_COLUMNS, _INTERMEDIATE_COLUMNS, ShardPlan, shard_tensor

log = structlog.get_logger()



class QuantLinear(Module):
    """``x @ W.T + b`` with ``W`` the rows of one or more ``QuantPack``s, in ``x``'s dtype."""

    def __init__(self, packs: list, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packs, self.bias = packs, bias
        self.in_features = packs[0].in_features
        self.out_features = sum(p.out_features for p in packs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kernels.cpu.quant_matmul import quant_matmul

        flat = x.reshape(-1, x.shape[-1])
        ys = [quant_matmul(flat, p) for p in self.packs]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class QuantEmbedding(VocabEmbedding):
    """A ``VocabEmbedding`` whose rows are dequantized from their blocks at each lookup."""

    def __init__(self, old: VocabEmbedding, pack, dtype: torch.dtype) -> None:
        Module.__init__(self)
        self.vocab_range, self.comm, self.pack, self.dtype = old.vocab_range, old.comm, pack, dtype

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        from kernels.cpu.quant_matmul import dequantize_rows

        return dequantize_rows(self.pack, ids.reshape(-1).to(torch.int64).numpy()).to(self.dtype)


def shard_quantized(name: str, w: QuantWeight, plan: ShardPlan) -> QuantWeight:
    """Rank ``plan.rank``'s part of a quantized weight: the rows ``shard_tensor`` cuts (the blocks'
    bytes are whole rows), or for a row-parallel layer the inputs it cuts, whole blocks only."""
    kind = name.split(".")[-2]
    if kind not in _HEAD_COLUMNS + _INTERMEDIATE_COLUMNS:
        return QuantWeight(shard_tensor(name, w.raw, plan), w.ggml_type, w.in_features)
    cols = shard_tensor(name, torch.arange(w.in_features).unsqueeze(0), plan)[0]
    start, count = int(cols[0]), len(cols)
    if start % w.block or count % w.block:
        raise ValueError(f"--tensor-parallel-size {plan.world_size}: {name} ({w.type_name}, blocks of {w.block}) "
                         f"would take inputs {start}..{start + count}, not whole blocks; it cannot be served quantized so "
                         f"(--quantization none dequantizes)")
    per_block = w.raw.shape[1] // (w.in_features // w.block)
    lo, hi = start // w.block * per_block, (start + count) // w.block * per_block
    return QuantWeight(w.raw[:, lo:hi].clone(), w.ggml_type, count)


def kernel_pack(p, dtype: torch.dtype):
    """What a matmul multiplies with: in bfloat16 a 4-bit pack in torch's int4 layout where it fits
    (``kernels/cpu/quant_matmul.py``: ``Int4Pack``), else the pack itself (the Numba kernels)."""
    from kernels.cpu.quant_matmul import Int4Pack, int4_supported

    return Int4Pack(p) if dtype == torch.bfloat16 and int4_supported(p) else p


def _packs(parts: list[QuantWeight]) -> list:
    """The kernels' packs of ``parts`` (a fused projection's, in order): adjacent parts of one type
    joined by rows into one pack."""
    from kernels.cpu.quant_matmul import pack

    runs: list[list[QuantWeight]] = []
    for p in parts:
        if runs and runs[-1][0].ggml_type == p.ggml_type:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [pack(torch.cat([p.raw for p in run]), run[0].ggml_type) for run in runs]


def fused_names(quantized: dict[str, QuantWeight], partial: bool = False) -> dict[str, list[str]]:
    """Our module names (``...qkv_proj``) -> the HF weight names whose rows they join, in order
    (``partial``: also where only some of the parts are there, else an error)."""
    out: dict[str, list[str]] = {}
    for name in quantized:
        module = name.removesuffix(".weight")
        target = module
        for fused, parts in FUSED_PROJECTIONS.items():
            for part in parts:
                if module.endswith("." + part):
                    target = module[: -len(part)] + fused
        out.setdefault(target, []).append(name)
    for target, names in out.items():
        parts = next((p for f, p in FUSED_PROJECTIONS.items() if target.endswith("." + f)), None)
        if parts is not None:
            names.sort(key=lambda n: [p in n for p in parts].index(True))
            if len(names) != len(parts) and not partial:
                raise ValueError(f"{target}: the file holds only some of its parts quantized ({', '.join(names)})")
    return out


def take_quantized(state: dict) -> tuple[dict, dict[str, QuantWeight]]:
    """``state`` split into its float tensors and its ``QuantWeight``s. A fused projection whose
    parts are only partly served quantized (llama.cpp's Q4_K_M gives a 576-wide q and k Q5_0,
    which is dequantized at read, beside a Q8_0 v) is served in float whole: its quantized parts
    are dequantized too (``kernels/quant_reference.py``), and logged."""
    from kernels.quant_reference import dequantize

    plain = {k: v for k, v in state.items() if not isinstance(v, QuantWeight)}
    quantized = {k: v for k, v in state.items() if isinstance(v, QuantWeight)}
    for target, names in fused_names(quantized, partial=True).items():
        parts = next((p for f, p in FUSED_PROJECTIONS.items() if target.endswith("." + f)), None)
        if parts is not None and len(names) != len(parts):
            log.info("fused projection dequantized", module=target, quantized=names)
            for name in names:
                w = quantized.pop(name)
                plain[name] = dequantize(w.raw, w.ggml_type)
    return plain, quantized


def install_quantized(model, quantized: dict[str, QuantWeight], plan: ShardPlan, dtype: torch.dtype) -> None:
    """Replace each module whose weight ``quantized`` holds by its quantized form (see the module's
    docstring); a tied LM head multiplies with the embedding's pack."""
    embed = model.input_embeddings
    for target, names in fused_names(quantized).items():
        parts = [shard_quantized(n, quantized[n], plan) for n in names]
        packs = _packs(parts)
        parent_name, _, attr = target.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        if old is embed:
            setattr(parent, attr, QuantEmbedding(old, packs[0], dtype))
            if model.config.tie_word_embeddings:
                model.lm_head = QuantLinear([kernel_pack(p, dtype) for p in packs], None)
        else:
            setattr(parent, attr, QuantLinear([kernel_pack(p, dtype) for p in packs], getattr(old, "bias", None)))


def weights_summary(model) -> dict:
    """The executor's "model loaded" fields: the weights' bytes, and for a quantized model its
    kernel, types and why the kernel (``kernels/cpu/quant_matmul.py``)."""
    summary = quantized_summary(model)
    if not summary["quantized_types"]:
        return {"weight_bytes": summary["weight_bytes"]}
    from kernels.cpu.quant_matmul import PREFILL_ROWS, Int4Pack

    kernels = {}
    for m in model.modules():
        for p in getattr(m, "packs", None) or []:
            kernels[p.type_name] = (getattr(p, "kernel", None) or
                                    "torch int4pack (bfloat16: a fifth of the Numba pass's time at one row)"
                                    if isinstance(p, Int4Pack) or hasattr(p, "kernel") else
                                    f"numba below {PREFILL_ROWS[p.four_bit]} rows (one pass over the blocks), "
                                    "then float32 tiles and torch's matmul")
    return {**summary, "quantized_kernels": kernels}


def quantized_summary(model) -> dict:
    """What the log says of the weights: bytes in memory (quantized packs, float parameters and
    linear.py's packed copies; not the computed tables), and how many matrices of each type are served quantized."""
    types: dict[str, int] = {}
    packs = {}
    for m in model.modules():
        for p in getattr(m, "packs", None) or ([m.pack] if hasattr(m, "pack") else []):
            packs[id(p)] = p
    for p in packs.values():
        types[p.type_name] = types.get(p.type_name, 0) + 1
    quant_bytes = sum(p.nbytes for p in packs.values())
    seen, float_bytes = set(), 0
    tensors = [t for m in model.modules() for t in (*m._parameters.values(), getattr(m, "packed", None))]
    for t in tensors:  # parameters, and the packed copies of linear.py's layers (numpy, or oneDNN's)
        key = t.data_ptr() if isinstance(t, torch.Tensor) and t.layout == torch.strided else id(t)
        if t is not None and key not in seen:
            seen.add(key)
            float_bytes += t.nbytes if isinstance(t, np.ndarray) else t.numel() * t.element_size()
    return {"quantized_types": types, "weight_bytes": int(quant_bytes + float_bytes),
            "quantized_bytes": int(quant_bytes)}
