"""A random-weight model with SmolLM2-135M's sizes, cut into heads that ``-tp N`` can split.

SmolLM2-135M has 9 attention heads of 64 dimensions and 3 KV heads: only ``-tp`` 1, 3 and 9
split it. The same 576-wide projections cut into narrower heads (12 of 48 with 4 KV heads, for
``-tp 2`` and 4) keep every weight matrix, every matmul and the KV cache the same size, so the
engine does the same work per token; only the head count changes. Its weights are random, so its
text is noise: the throughput workload sets ``ignore_eos`` and counts tokens, not meaning.
"""

from __future__ import annotations

import os

from shared.hub_kernels import hide_hub_kernels


def head_dim_for(hidden_size: int, kv_width: int, world_size: int, head_dim: int) -> int | None:
    """The widest head dimension (at most ``head_dim``) whose heads and KV heads ``world_size``
    ranks can split (heads divisible by N; KV heads dividing or divisible by N); None if none."""
    for dim in range(head_dim, 7, -1):
        if hidden_size % dim or kv_width % dim:
            continue
        heads, kv_heads = hidden_size // dim, kv_width // dim
        if heads % world_size == 0 and (kv_heads % world_size == 0 or world_size % kv_heads == 0):
            return dim
    return None


def smollm2_shaped_for(world_size: int, directory: str) -> str | None:
    """None when SmolLM2 itself splits ``world_size`` ways; else a SmolLM2-sized random model
    (with SmolLM2's tokenizer) saved under ``directory``, and its path."""
    hide_hub_kernels()
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    from shared.model_source import resolve_model

    src = resolve_model(None)
    cfg = AutoConfig.from_pretrained(src.directory, **src.pretrained_kwargs())
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % world_size == 0 and (kv_heads % world_size == 0 or world_size % kv_heads == 0):
        return None
    old_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dim = head_dim_for(cfg.hidden_size, kv_heads * old_dim, world_size, old_dim)
    if dim is None:
        raise SystemExit(f"no head size splits SmolLM2's {cfg.hidden_size} dimensions {world_size} ways")
    cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads = dim, cfg.hidden_size // dim, kv_heads * old_dim // dim
    path = os.path.join(directory, f"smollm2-shaped-{cfg.num_attention_heads}x{dim}")
    LlamaForCausalLM(cfg).save_pretrained(path)
    AutoTokenizer.from_pretrained(src.directory, **src.pretrained_kwargs()).save_pretrained(path)
    return path
