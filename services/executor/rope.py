"""A model's rotary frequencies, read from its config: the plain and linearly scaled kinds computed
here (as every transformers model computes its default), every other static kind (``llama3``,
``yarn``, ``longrope``, ...) by transformers' own ``ROPE_INIT_FUNCTIONS``, so a scaling is computed
by the code its checkpoints were made with. ``partial_rotary_factor`` < 1 rotates the first part
of each head only (fewer frequencies).

One kind is per position here where transformers decides per forward pass: ``longrope`` (Phi-3.5)
takes its short factors below ``original_max_position_embeddings`` and its long ones from there on
(as vLLM's table does), where transformers switches the whole pass to the long factors once its
longest sequence passes that length. Up to that length the two agree. ``dynamic`` (NTK) changes
its base with the batch's longest sequence in transformers: refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shared.hub_kernels import hide_hub_kernels

_OWN_KINDS = ("default", "linear")
_CPU = torch.device("cpu")  # tables are built on the CPU, also inside a meta-device model build


@dataclass(frozen=True)
class Rope:
    """Frequencies of one rotary table (float32 values), ``[rotary_dim / 2]``."""

    inv_freq: tuple[float, ...]
    attention_factor: float = 1.0  # cos and sin are scaled by it (yarn, longrope)
    long_inv_freq: tuple[float, ...] = ()  # longrope: the frequencies from ``original_max_positions`` on
    original_max_positions: int = 0

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)


def plain_rope(head_dim: int, theta: float, linear_factor: float = 1.0, partial: float = 1.0) -> Rope:
    """transformers' default frequencies (``1 / theta ** (2i / dim)`` in float32) over the first
    ``dim = head_dim * partial`` channels, positions divided by ``linear_factor``."""
    dim = int(head_dim * partial)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=_CPU).float() / dim
    return Rope(tuple((1.0 / (theta ** exponents) / linear_factor).tolist()))


def rope_kind(params: dict[str, Any] | None) -> str:
    params = params or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def rope_from_config(hf, params: dict[str, Any] | None, head_dim: int, where: str,
                     layer_type: str | None = None) -> Rope:
    """The table of ``params`` (one rope parameter set: transformers v5's ``rope_parameters``, or
    the set of ``layer_type`` where the config has one per layer type, or v4's ``rope_scaling``)."""
    params = params or {}
    kind = rope_kind(params)
    partial = float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", None) or 1.0))
    if not 0.0 < partial <= 1.0 or int(head_dim * partial) % 2:
        raise ValueError(f"{where}: partial_rotary_factor {partial} must give an even share of head_dim {head_dim}")
    if kind in _OWN_KINDS:
        theta = params.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)
        return plain_rope(head_dim, float(theta), float(params["factor"]) if kind == "linear" else 1.0, partial)
    hide_hub_kernels()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    static = sorted(k for k in ROPE_INIT_FUNCTIONS if k != "dynamic")
    if kind == "dynamic" or kind not in ROPE_INIT_FUNCTIONS or not hasattr(hf, "standardize_rope_params"):
        raise ValueError(f"{where}: rope type {kind!r} is not supported (supported: default, "
                         f"{', '.join(static)}; 'dynamic' changes with the batch's longest sequence)")
    init = ROPE_INIT_FUNCTIONS[kind]
    with _CPU:
        inv_freq, factor = init(hf, _CPU, layer_type=layer_type)
    if kind != "longrope":
        return Rope(tuple(inv_freq.float().tolist()), float(factor))
    original = int(params.get("original_max_position_embeddings")
                   or getattr(hf, "original_max_position_embeddings", None) or hf.max_position_embeddings)
    with _CPU:
        long_freq, _ = init(hf, _CPU, seq_len=original + 1, layer_type=layer_type)
    return Rope(tuple(inv_freq.float().tolist()), float(factor), tuple(long_freq.float().tolist()), original)


def cos_sin(rope: Rope, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin ``[max_positions, rotary_dim]`` (each frequency twice, ``rotate_half``'s
    layout), scaled by the attention factor as transformers scales them."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=_CPU)
    freqs = torch.outer(positions, torch.tensor(rope.inv_freq, dtype=torch.float32, device=_CPU))
    if rope.long_inv_freq and max_positions > rope.original_max_positions:
        long = torch.outer(positions, torch.tensor(rope.long_inv_freq, dtype=torch.float32, device=_CPU))
        freqs[rope.original_max_positions:] = long[rope.original_max_positions:]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos, sin
