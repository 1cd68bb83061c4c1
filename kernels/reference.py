"""PyTorch reference forms of the paged-attention kernels: they define what is correct.

Layouts shared by every form (reference, Numba CPU, Numba CUDA):

- ``key_cache``, ``value_cache``: ``[num_blocks, num_kv_heads, block_size, head_dim]``; token ``t``
  of a sequence lives in block ``block_tables[s, t // block_size]`` at offset ``t % block_size``.
  A *slot* is ``block_id * block_size + offset``.
- ``block_tables``: ``[num_seqs, max_blocks]`` int32; entries past a sequence's last block are padding.
- ``context_lens``: ``[num_seqs]`` int32, tokens in the cache for each sequence *including* the ones
  written in this step. Ranges are half-open: a sequence attends to positions ``[0, context_len)``.
- Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
- ``window`` (sliding window, Mistral / Phi-3 / Gemma): with ``window > 0`` a query at position
  ``p`` attends to ``p - window < j <= p`` only, and the block-table entries of blocks wholly
  before that may be garbage (freed: -1 or 0), never read. ``softcap`` (Gemma 2's
  ``attn_logit_softcapping``): with ``softcap > 0`` each score ``q . k * scale`` becomes
  ``softcap * tanh(score / softcap)`` before the mask and the softmax. 0: neither (the defaults).

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


def _window_start(position: int, window: int) -> int:
    """The first position a query at ``position`` attends to: ``position - window + 1`` (the last
    ``window`` keys, itself included) with a window, else 0."""
    return max(0, position - window + 1) if window > 0 else 0


def _gather_range(cache: torch.Tensor, block_table: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Positions ``[first, end)`` of one sequence as ``[num_kv_heads, end - first, head_dim]``.
    Only the blocks holding those positions are read: the table's entries before ``first``'s
    block may be garbage (a sliding window's blocks freed by the block manager, -1 or 0)."""
    block_size = cache.shape[2]
    b0, b1 = first // block_size, (end + block_size - 1) // block_size
    blocks = cache[block_table[b0:b1].long()]  # [nb, Hkv, bs, D]
    flat = blocks.permute(1, 0, 2, 3).reshape(cache.shape[1], (b1 - b0) * block_size, -1)
    return flat[:, first - b0 * block_size:end - b0 * block_size]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            scale: float, softcap: float) -> torch.Tensor:
    """Eager attention as transformers' Gemma 2 ``eager_attention_forward`` writes it, in float32:
    ``q [H, Q, D]``, ``keys``/``values`` ``[Hkv, L, D]`` (grouped-query heads repeated), ``mask
    [Q, L]`` (True: attended). Scores ``q . k * scale``; with ``softcap > 0``, ``softcap *
    tanh(scores / softcap)``; then the mask, then the softmax. Returns ``[H, Q, D]``."""
    group = q.shape[0] // keys.shape[0]
    keys = keys.float().repeat_interleave(group, dim=0)
    values = values.float().repeat_interleave(group, dim=0)
    scores = torch.matmul(q.float(), keys.transpose(1, 2)) * scale  # [H, Q, L]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32), values)


def _attend_sequence(query: torch.Tensor, key_cache, value_cache, block_table, length: int,
                     scale: float, window: int, softcap: float) -> torch.Tensor:
    """The ``q_len`` query rows ``[q_len, H, D]`` of one sequence, the last positions of its
    ``length``: row ``j`` at position ``p = length - q_len + j`` attends to ``[_window_start(p),
    p]``. Only the positions some row attends to are gathered. Returns ``[q_len, H, D]`` float32."""
    q_len = query.shape[0]
    first = _window_start(length - q_len, window)
    keys = _gather_range(key_cache, block_table, first, length)
    values = _gather_range(value_cache, block_table, first, length)
    q_pos = torch.arange(length - q_len, length, device=query.device)[:, None]
    k_pos = torch.arange(first, length, device=query.device)[None, :]
    mask = k_pos <= q_pos
    if window > 0:
        mask &= k_pos > q_pos - window
    return _attend(query.transpose(0, 1), keys, values, mask, scale, softcap).transpose(0, 1)


def paged_decode_attention(
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """One query token per sequence (at position ``p = context_len - 1``) over its context.

    ``window > 0``: a sliding window, keys at ``p - window < j <= p`` only (the blocks before it
    are not read, their table entries may be garbage). ``softcap > 0``: logit soft-capping,
    ``softcap * tanh(score / softcap)`` before the softmax (Gemma 2). Defaults: neither."""
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return
    if window > 0 or softcap > 0:
        lens = context_lens.tolist()
        for s in range(num_seqs):
            out[s:s + 1] = _attend_sequence(query[s:s + 1], key_cache, value_cache, block_tables[s],
                                            lens[s], scale, window, softcap).to(out.dtype)
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
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """The new tokens of each sequence attend causally to themselves and its cached prefix.

    Sequence ``s`` owns query rows ``[query_start_loc[s], query_start_loc[s + 1])``; with
    ``q_len`` of them, row ``j`` is at position ``p = context_len - q_len + j`` and attends to
    positions ``[0, p]`` (the K/V of the new tokens are already written); with ``window > 0``
    to ``(p - window, p]`` only. ``softcap``: as in ``paged_decode_attention``.
    """
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for s in range(len(lens)):
        start, end, length = starts[s], starts[s + 1], lens[s]
        if end == start:
            continue
        if window > 0 or softcap > 0:
            out[start:end] = _attend_sequence(query[start:end], key_cache, value_cache, block_tables[s],
                                              length, scale, window, softcap).to(out.dtype)
            continue
        q_len = end - start
        keys = _gather_range(key_cache, block_tables[s], 0, length).float()  # [Hkv, L, D]
        values = _gather_range(value_cache, block_tables[s], 0, length).float()
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
