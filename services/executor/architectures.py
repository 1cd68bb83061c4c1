"""The model families the executor builds, by the ``model_type`` of a transformers config: the
class (``model.CausalLM``'s subclasses) and its config, for the loader and the group's layout."""

from __future__ import annotations

from .model import CausalLM, LlamaForCausalLM
from .opt import OPTForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "opt": OPTForCausalLM,
}


def model_class(hf_config) -> type[CausalLM]:
    """Our model class for ``hf_config``, or a ``ValueError`` naming the supported types."""
    cls = MODEL_CLASSES.get(getattr(hf_config, "model_type", None))
    if cls is None:
        raise ValueError(f"model type {getattr(hf_config, 'model_type', None)!r} is not supported "
                         f"({', '.join(MODEL_CLASSES)})")
    return cls


def model_config(hf_config):
    """``hf_config`` read into its family's config (``ModelConfig`` or ``OPTConfig``)."""
    return model_class(hf_config).config_class.from_hf(hf_config)
