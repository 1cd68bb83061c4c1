"""``--quantization int8``: weight-only int8 with one scale per output channel, made at load from the
model's float weights (a Hugging Face checkpoint's, or a GGUF file's dequantized ones).

Every matmul weight of the decoder (q, k, v, o, gate, up, down; an untied LM head) and the token
embeddings are quantized symmetrically, ``q = round(w / s)`` in -127..127 with ``s = max|w| / 127``
(rounded to bfloat16) over the whole row, after the family's names are settled (``Family.hf_state_dict``) and before
tensor parallelism cuts them (``split_int8``): every rank serves the same bits, a row-parallel
layer's ranks keep the whole rows' scales, and ``-tp N`` adds up to one rank's products.

The matmul (``Int8Linear``), chosen by measurement (docs/benchmarks.md: one SmolLM2 layer's four
matmuls on the 2-core Xeon with AMX, bfloat16): below ``INT8PACK_ROWS`` rows torch's int8 kernel
(``_weight_int8pack_mm``: 0.5x the bf16 oneDNN matmul's time at one row, the same at four, 3x at
16), from there the weight dequantized in tiles and torch's matmul (at 64 rows 2.4x oneDNN's time,
where the int8 kernel took 8x). Per output channel rather than GGUF's Q8_0 blocks of 32 (the GGUF
path's format, whose scales would split on any block edge): the whole model decoded one stream
1.2-1.35x faster and four streams 2x, though Q8_0 kept closer to the bf16 model's greedy tokens. Activations stay in the model's dtype: nothing to
calibrate; in float32 the products equal the dequantized weight's within float rounding.
"""

from __future__ import annotations

import re

import torch

from .model import VocabEmbedding, fuse_projections
from .module import Module
from .parallel.sharding import _HEAD_COLUMNS, _INTERMEDIATE_COLUMNS, ShardPlan, shard_tensor

INT8PACK_ROWS = 24  # rows from which the dequantized tiles win (int8 kernel: 0.7x their time at 16 rows, 2.2x at 64)
TILE_ROWS = 4096  # output rows dequantized at a time
_MATMULS = re.compile(r"(\.(q|k|v|o|gate|up|down)_proj\.weight|^model\.embed_tokens\.weight|^lm_head\.weight)$")


class Int8Weight:
    """One weight ``[out, in]``: int8 values and a float32 scale per output row."""

    type_name, four_bit = "int8", False
    kernel = f"torch int8pack below {INT8PACK_ROWS} rows, then dequantized tiles and torch's matmul (measured)"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.q, self.scale = q.contiguous(), scale.float().contiguous()
        self.out_features, self.in_features = q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4


class Int8Linear(Module):
    """``x @ W.T + b`` over an ``Int8Weight``, in ``x``'s dtype."""

    def __init__(self, weight: Int8Weight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.packs, self.bias = [weight], bias  # ``packs``: as quantized.QuantLinear's, for the summary
        self.in_features, self.out_features = weight.in_features, weight.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.packs[0]
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        if flat.shape[0] < INT8PACK_ROWS and int8pack_takes(x.dtype, w.in_features):
            y = torch.ops.aten._weight_int8pack_mm(flat, w.q, w.scale.to(x.dtype))
        else:
            y = torch.empty(flat.shape[0], w.out_features, dtype=x.dtype)
            for start in range(0, w.out_features, TILE_ROWS):
                stop = min(start + TILE_ROWS, w.out_features)
                tile = w.q[start:stop].to(x.dtype) * w.scale[start:stop, None].to(x.dtype)
                y[:, start:stop] = torch.nn.functional.linear(flat, tile)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], w.out_features)


def int8pack_takes(dtype: torch.dtype, in_features: int) -> bool:
    """Whether torch's int8 kernel computes ``dtype`` rows of ``in_features`` right: float32 any
    width; bfloat16 only widths that are multiples of 16 (torch 2.13 reads them in 16s: another
    width gave infinities or a crash, tried here); anything else is left to the tiles."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and in_features % 16 == 0)


class Int8Embedding(VocabEmbedding):
    """A ``VocabEmbedding`` whose rows are dequantized from int8 at each lookup."""

    def __init__(self, old: VocabEmbedding, weight: Int8Weight, dtype: torch.dtype) -> None:
        Module.__init__(self)
        self.vocab_range, self.comm, self.pack, self.dtype = old.vocab_range, old.comm, weight, dtype

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        rows = ids.reshape(-1).to(torch.int64)
        return (self.pack.q[rows].float() * self.pack.scale[rows, None]).to(self.dtype)


def quantize_state_int8(state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """``state`` with each matmul weight replaced by its int8 values (loaded into the model's float
    parameters, which hold them exactly, until ``install_int8`` takes them), and those weights'
    scales ``[out, 1]`` under the same names: ``max|w| / 127`` rounded to bfloat16, since torch's
    int8 kernel takes its scales in the activations' dtype, and ``q`` quantized against that scale."""
    out, scales = dict(state), {}
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and t.ndim == 2 and _MATMULS.search(name):
            w = t.detach().float()
            scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
            scale = scale.bfloat16().float()  # what torch's kernel multiplies with in bfloat16: q fits it
            out[name], scales[name] = torch.round(w / scale).clamp_(-127, 127).to(torch.int8), scale
    return out, scales


def split_int8(scales: dict[str, torch.Tensor], plan: ShardPlan) -> dict[str, torch.Tensor]:
    """This rank's scales, fused as the weights are: a column-parallel layer's rows cut as its
    weight's, a row-parallel layer's (o, down) whole."""
    mine = {n: s if n.split(".")[-2] in _HEAD_COLUMNS + _INTERMEDIATE_COLUMNS else shard_tensor(n, s, plan)
            for n, s in scales.items()}
    return fuse_projections(mine)


def install_int8(model, scales: dict[str, torch.Tensor], dtype: torch.dtype) -> int:
    """Replace each module whose weight has a scale in ``scales`` (``split_int8``'s) by its int8
    form; a tied LM head multiplies with the embedding's. Returns how many were replaced."""
    embed, head = model.input_embeddings, model.lm_head
    tied = head.weight is embed.weight
    count = 0
    for name, module in list(model.named_modules()):
        scale = scales.get(f"{name}.weight")
        if scale is None or (tied and module is head):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        weight = Int8Weight(module.weight.detach().to(torch.int8), scale[:, 0])
        if module is embed:
            setattr(parent, attr, Int8Embedding(module, weight, dtype))
            if tied:
                model.lm_head = Int8Linear(weight, None)
        else:
            setattr(parent, attr, Int8Linear(weight, getattr(module, "bias", None)))
        count += 1
    if count != len(scales) - (tied and "lm_head.weight" in scales):  # a weight left with int8 values: wrong
        raise ValueError(f"--quantization int8: {len(scales)} weights quantized but {count} layers hold them")
    return count
