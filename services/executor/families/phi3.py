"""Phi-3 and Phi-3.5: Llama's layers, with the q/k/v and gate/up weights stored fused
(``qkv_proj``, ``gate_up_proj``): split here into Hugging Face's parts, so that tensor parallelism
cuts them by heads and columns as any other family's (``model.fuse_projections`` joins each rank's
parts again); a sliding window on every layer where ``sliding_window`` is set. Phi-3.5's
``longrope`` and Phi-4-mini's partial rotary come with the shared rotary table (``rope.py``)."""

import torch

from .common import decoder_config, layer_windows


def config(hf):
    return decoder_config(hf, layer_windows=layer_windows(hf, hf.num_hidden_layers, "model phi3", every_layer=True))


def hf_state_dict(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    out = {}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, t in state.items():
        if ".self_attn.qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                out[name.replace("qkv_proj", part)] = piece
        elif ".mlp.gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), t.chunk(2)):
                out[name.replace("gate_up_proj", part)] = piece
        elif "rotary_emb" not in name:
            out[name] = t
    return out
