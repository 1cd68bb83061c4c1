"""Gemma 3's text model (``gemma3_text``: the 270M and 1B, and the language half of the larger
ones saved as text models): Gemma 2's layers with an RMS norm of each query and key head, no
soft-capping, five windowed layers to each global one (``layer_types``), and the windowed layers
on a rotary base of their own (``rope_parameters["sliding_attention"]``; the global layers'
may be scaled). A multimodal ``gemma3`` checkpoint is served as this text model
(``shared.hf_config.TEXT_MODELS``): text in, text out."""

from shared.hf_config import model_shape

from ..rope import plain_rope, rope_from_config
from .common import decoder_config
from .gemma2 import gemma_knobs
from .gemma2 import hf_state_dict as gemma2_state_dict

# A multimodal Gemma 3 checkpoint (``gemma3``: the 4B, 12B, 27B) is served as its text model: its
# language model's tensors renamed to the text model's, the image tower and projector left out.
_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."))
_IMAGE_PARTS = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def config(hf):
    where = "model gemma3_text"
    head_dim = model_shape(hf.to_dict(), where).head_dim
    params = getattr(hf, "rope_parameters", None) or {}
    if "full_attention" in params:  # transformers v5: one set per layer type
        rope = rope_from_config(hf, params["full_attention"], head_dim, where, layer_type="full_attention")
        local = rope_from_config(hf, params.get("sliding_attention"), head_dim, where, layer_type="sliding_attention")
    else:  # v4: rope_theta and rope_scaling for the global layers, rope_local_base_freq for the others
        rope = rope_from_config(hf, getattr(hf, "rope_scaling", None), head_dim, where)
        local = plain_rope(head_dim, float(getattr(hf, "rope_local_base_freq", 10000.0)))
    return decoder_config(hf, **gemma_knobs(hf, where), qk_norm=True, rope=rope, local_rope=local,
                          attn_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
                          final_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0))


def hf_state_dict(state, cfg):
    """Gemma 2's weight names and norms, a multimodal checkpoint's text model renamed to them."""
    text = {}
    for name, tensor in state.items():
        if name.startswith(_IMAGE_PARTS):
            continue
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        text[name] = tensor
    return gemma2_state_dict(text, cfg)
