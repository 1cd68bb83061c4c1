"""What the families' files share: reading the decoder's config from a transformers config
(sizes, norm epsilon, rotary frequencies) and the per-layer sliding windows."""

from __future__ import annotations

import dataclasses

import torch

from shared.hf_config import model_shape

from ..decoder import ModelConfig
from ..rope import rope_from_config


def layer_windows(hf, num_layers: int, where: str, every_layer: bool = False) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention) from ``sliding_window`` and, where the config
    has them, ``layer_types`` (Gemma 2 and 3, Qwen's ``use_sliding_window``); ``every_layer``: the
    window applies to all layers (Mistral, Phi-3). () when no layer has one."""
    window = getattr(hf, "sliding_window", None)
    if not window:
        return ()
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"{where}: sliding_window must be a positive integer, got {window!r}")
    types = None if every_layer else getattr(hf, "layer_types", None)
    if types is None:
        windows = (window,) * num_layers
    else:
        windows = tuple(window if kind == "sliding_attention" else 0 for kind in types)
    if not any(windows):
        return ()
    max_positions = getattr(hf, "max_position_embeddings", None)
    if isinstance(max_positions, int) and window > max_positions:
        raise ValueError(f"{where}: sliding_window {window} is larger than the context "
                         f"(max_position_embeddings {max_positions})")
    return windows


def decoder_config(hf, **knobs) -> ModelConfig:
    """The decoder's config for ``hf``: the sizes checked by ``model_shape`` (as every process reads
    them), the norm epsilon, the rotary table, no attention bias, then the family's ``knobs``."""
    where = f"model {hf.model_type}"
    shape = model_shape(hf.to_dict(), where)
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None)
    rope = knobs.pop("rope", None) or rope_from_config(hf, params, shape.head_dim, where)
    fields = dict(rms_norm_eps=hf.rms_norm_eps, rope=rope,
                  attention_bias=bool(getattr(hf, "attention_bias", False) or False))
    return ModelConfig(**dataclasses.asdict(shape), **{**fields, **knobs})


def unit_offset_norms(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gemma's norms scale by ``1 + weight``: the stored weights plus one (in float32, as Gemma's
    norm adds them), so that the shared RMS norm, which scales by its weight, computes the same."""
    return {k: (v.float() + 1.0 if k.endswith("norm.weight") else v) for k, v in state.items()}
