"""Gemma 3's text model (``gemma3_text``: the 270M and 1B, and the language half of the larger
ones saved as text models): Gemma 2's layers with an RMS norm of each query and key head, no
soft-capping, five windowed layers to each global one (``layer_types``), and the windowed layers
on a rotary base of their own (``rope_parameters["sliding_attention"]``; the global layers'
may be linearly scaled)."""

from .common import decoder_config, rope_of
from .gemma2 import gemma_knobs, hf_state_dict  # noqa: F401 (Gemma 2's weight names and norms)


def config(hf):
    where = "model gemma3_text"
    rope = getattr(hf, "rope_parameters", None) or {}
    if "full_attention" in rope:  # transformers v5: one set per layer type
        theta, factor = rope_of(rope["full_attention"], hf, where)
        local, _ = rope_of(rope.get("sliding_attention"), hf, where)
    else:  # v4: rope_theta and rope_scaling for the global layers, rope_local_base_freq for the others
        theta, factor = rope_of(getattr(hf, "rope_scaling", None), hf, where)
        local = float(getattr(hf, "rope_local_base_freq", 10000.0))
    return decoder_config(hf, **gemma_knobs(hf, where), qk_norm=True, rope_theta=theta,
                          rope_linear_factor=factor, local_rope_theta=local,
                          attn_softcap=float(getattr(hf, "attn_logit_softcapping", None) or 0.0),
                          final_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0))
