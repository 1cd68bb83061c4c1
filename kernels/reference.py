"""PyTorch reference forms of the paged-attention kernels: they define what is correct.

Layouts shared by every form (reference, Numba CPU, Numba CUDA):

- ``key_cache``, ``value_cache``: ``[num_blocks, num_kv_heads, block_size, head_dim]``; token ``t``
  of a sequence lives in block ``block_tables[s, t // block_size]`` at offset ``t % block_size``.
  A *slot* is ``block_id * block_size + offset``.
- ``block_tables``: ``[num_seqs, max_blocks]`` int32; entries past a sequence's last block are padding.
- ``context_lens``: ``[num_seqs]`` int32, tokens in the cache for each sequence *including* the ones
  written in this step. Ranges are half-open: a sequence attends to positions ``[0, context_len)``.
- Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

Every function writes its output argument in place (outputs first, then inputs, then scalars).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot is padding and is skipped
) -> None:
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value[keep].to(value_cache.dtype)


def _gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence as ``[num_kv_heads, length, head_dim]``."""
    block_size = cache.shape[2]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]  # [nb, Hkv, bs, D]
    return blocks.permute(1, 0, 2, 3).reshape(cache.shape[1], num_blocks * block_size, -1)[:, :length]


def paged_decode_attention(
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    scale: float,
) -> None:
    """One query token per sequence (at position ``context_len - 1``) over its whole context."""
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return
    block_size = key_cache.shape[2]
    max_len = int(context_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks].long()
    # Gather every sequence's blocks: [S, nb, Hkv, bs, D] -> [S, Hkv, nb * bs, D].
    keys = key_cache[tables].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :max_len]
    values = value_cache[tables].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :max_len]
    positions = torch.arange(max_len, device=query.device)
    mask = (positions[None, :] < context_lens[:, None].to(query.device))[:, None, None, :]  # [S,1,1,L]
    result = F.scaled_dot_product_attention(
        query.unsqueeze(2).float(), keys.float(), values.float(), attn_mask=mask, scale=scale,
        enable_gqa=True,
    )  # [S, H, 1, D]
    out.copy_(result.squeeze(2).to(out.dtype))


def paged_prefill_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> None:
    """The new tokens of each sequence attend causally to themselves and its cached prefix.

    Sequence ``s`` owns query rows ``[query_start_loc[s], query_start_loc[s + 1])``; with
    ``q_len`` of them, row ``j`` is at position ``context_len - q_len + j`` and attends to
    positions ``[0, context_len - q_len + j]`` (the K/V of the new tokens are already written).
    """
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for s in range(len(lens)):
        start, end, length = starts[s], starts[s + 1], lens[s]
        q_len = end - start
        if q_len == 0:
            continue
        keys = _gather_sequence(key_cache, block_tables[s], length).float()  # [Hkv, L, D]
        values = _gather_sequence(value_cache, block_tables[s], length).float()
        q = query[start:end].transpose(0, 1).float()  # [H, q_len, D]
        q_pos = torch.arange(length - q_len, length, device=query.device)
        k_pos = torch.arange(length, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, L]
        result = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [H, q_len, D]
        out[start:end] = result.transpose(0, 1).to(out.dtype)


def copy_blocks(
    key_caches: list[torch.Tensor],  # per layer [num_blocks, num_kv_heads, block_size, head_dim]
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src, dst)
) -> None:
    """Copy whole blocks inside the pool (copy-on-write), every layer."""
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for cache in (*key_caches, *value_caches):
        cache[dst] = cache[src]


def swap_blocks(
    dst: torch.Tensor,  # [num_dst_blocks, ...] one layer's pool (device or CPU)
    src: torch.Tensor,  # [num_src_blocks, ...] the other pool, same block shape
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64 (src block, dst block)
) -> None:
    """Move whole blocks between the device pool and the CPU swap pool."""
    if block_mapping.numel() == 0:
        return
    src_ids, dst_ids = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    dst[dst_ids.to(dst.device)] = src[src_ids.to(src.device)].to(dst.device)
