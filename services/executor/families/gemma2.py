"""Gemma 2: sliding-window and global layers alternating (``layer_types``), attention scores and
final logits soft-capped, norms before and after attention and the MLP (sandwich), norms that scale
by ``1 + weight``, the embeddings times sqrt(hidden_size), a GELU (tanh) gated MLP, and the query
scale from ``query_pre_attn_scalar``."""

from .common import decoder_config, layer_windows, unit_offset_norms


def gemma_knobs(hf, where: str) -> dict:
    """What Gemma 2 and 3 share."""
    return dict(
        sandwich_norms=True, hidden_act=getattr(hf, "hidden_activation", None) or "gelu_pytorch_tanh",
        embedding_scale=hf.hidden_size**0.5, query_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        layer_windows=layer_windows(hf, hf.num_hidden_layers, where),
    )


def config(hf):
    return decoder_config(hf, **gemma_knobs(hf, "model gemma2"),
                          attn_softcap=float(hf.attn_logit_softcapping or 0.0),
                          final_softcap=float(hf.final_logit_softcapping or 0.0))


def hf_state_dict(state, cfg):
    return unit_offset_norms({k: v for k, v in state.items() if "rotary_emb" not in k})
