"""The registry of model families the executor builds, by the ``model_type`` of a transformers
config: each names its model class (``CausalLM``'s subclasses), how its config is read and how its
checkpoint's tensors map onto the class's parameters. A family is one small file in ``families/``
(or ``opt.py``) plus its line here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .decoder import DecoderForCausalLM
from .families import gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3
from .model import CausalLM
from .opt import OPTConfig, OPTForCausalLM


def _decoder_state_dict(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    return DecoderForCausalLM.hf_state_dict(state)


@dataclass(frozen=True)
class Family:
    model_class: type[CausalLM]
    config: Callable  # transformers config -> the class's config
    # a checkpoint's tensors (Hugging Face names) -> the class's Hugging Face names, before sharding and fusing
    hf_state_dict: Callable[[dict[str, torch.Tensor], object], dict[str, torch.Tensor]] = _decoder_state_dict


FAMILIES: dict[str, Family] = {
    "llama": Family(DecoderForCausalLM, llama.config),
    "mistral": Family(DecoderForCausalLM, mistral.config),
    "qwen2": Family(DecoderForCausalLM, qwen2.config),
    "qwen3": Family(DecoderForCausalLM, qwen3.config),
    "phi3": Family(DecoderForCausalLM, phi3.config, phi3.hf_state_dict),
    "gemma2": Family(DecoderForCausalLM, gemma2.config, gemma2.hf_state_dict),
    "gemma3_text": Family(DecoderForCausalLM, gemma3.config, gemma3.hf_state_dict),
    "opt": Family(OPTForCausalLM, OPTConfig.from_hf, lambda state, cfg: OPTForCausalLM.hf_state_dict(state)),
}


def family(hf_config) -> Family:
    """The family of ``hf_config``, or a ``ValueError`` naming the supported model types."""
    found = FAMILIES.get(getattr(hf_config, "model_type", None))
    if found is None:
        raise ValueError(f"model type {getattr(hf_config, 'model_type', None)!r} is not supported "
                         f"(supported: {', '.join(FAMILIES)})")
    return found


def model_class(hf_config) -> type[CausalLM]:
    return family(hf_config).model_class


def model_config(hf_config):
    """``hf_config`` read into its family's config (``decoder.ModelConfig`` or ``OPTConfig``)."""
    return family(hf_config).config(hf_config)
