"""Megatron-style sharding of a Llama-family or OPT model over ``world_size`` ranks: who holds what
(OPT's out_proj, fc1 and fc2 split as o_proj, gate/up and down do).

- q_proj: column-parallel by attention heads; rank r holds heads
  ``[r * H/N, (r + 1) * H/N)`` (N must divide H).
- k_proj, v_proj: by KV heads, vLLM's rule: with N <= Hkv each rank holds ``Hkv / N`` heads
  (N must divide Hkv); with N > Hkv each holds one, replicated on ``N / Hkv`` ranks (Hkv must
  divide N), and rank r holds KV head ``r // (N / Hkv)``. Either way the query heads a rank holds
  use only the KV heads it holds, and its KV pool stores only those.
- o_proj: row-parallel (the input columns of the rank's heads), then an all-reduce.
- gate_proj, up_proj: column-parallel over the intermediate size, rank r holding
  ``[r * I // N, (r + 1) * I // N)`` (uneven splits allowed: only the hidden size is reduced);
  down_proj: row-parallel over the same columns, then an all-reduce.
- embed_tokens and lm_head: split by vocabulary in equal shards of ``ceil(V / N)`` rows, the last
  one padded with zero rows. The embedding looks up the ids in its shard (zeros elsewhere) and
  all-reduces; the LM head's logits shards are gathered on rank 0 and the padding dropped.
- norms (and OPT's position embeddings and width projections): replicated. Biases follow their
  weight's output rows; a row-parallel layer's bias (OPT's) is added by rank 0 alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def __post_init__(self) -> None:
        n, h, hkv = self.world_size, self.num_heads, self.num_kv_heads
        if n < 1 or not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} is outside --tensor-parallel-size {n}")
        if h % n:
            raise ValueError(f"--tensor-parallel-size {n} must divide the number of attention heads ({h})")
        if hkv % n and n % hkv:
            raise ValueError(f"--tensor-parallel-size {n} and the {hkv} KV heads: one must divide the "
                             f"other (each rank holds {hkv}/{n} KV heads, or one replicated on {n}/{hkv} ranks)")

    @classmethod
    def for_model(cls, cfg, rank: int = 0, world_size: int = 1) -> "ShardPlan":
        """The plan of rank ``rank`` for a ``model.ModelConfig``."""
        return cls(rank, world_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                   cfg.vocab_size)

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def num_local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def num_kv_head_replicas(self) -> int:
        return max(1, self.world_size // self.num_kv_heads)

    @property
    def kv_head_start(self) -> int:
        return (self.rank // self.num_kv_head_replicas) * self.num_local_kv_heads

    @property
    def intermediate_range(self) -> tuple[int, int]:
        n, i = self.world_size, self.intermediate_size
        return self.rank * i // n, (self.rank + 1) * i // n

    @property
    def vocab_shard_size(self) -> int:
        return -(-self.vocab_size // self.world_size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """The token ids this rank's shard holds (the shard may have padding rows after them)."""
        start = self.rank * self.vocab_shard_size
        return min(start, self.vocab_size), min(start + self.vocab_shard_size, self.vocab_size)


def _rows(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return t[start:stop].clone()


def _columns(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return t[:, start:stop].clone()


def _vocab_rows(t: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    start, stop = plan.vocab_range
    out = t.new_zeros((plan.vocab_shard_size, *t.shape[1:]))
    out[: stop - start] = t[start:stop]
    return out


# Hugging Face parameter kinds (the module name before ``.weight``/``.bias``) by how they split
_HEAD_ROWS = ("q_proj",)
_KV_HEAD_ROWS = ("k_proj", "v_proj")
_INTERMEDIATE_ROWS = ("gate_proj", "up_proj", "fc1")  # column-parallel MLP input (OPT: fc1)
_HEAD_COLUMNS = ("o_proj", "out_proj")  # row-parallel: attention output (OPT: out_proj)
_INTERMEDIATE_COLUMNS = ("down_proj", "fc2")  # row-parallel: MLP output (OPT: fc2)
_VOCAB_ROWS = ("model.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")


def shard_tensor(name: str, t: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
    """Rank ``plan.rank``'s slice of the Hugging Face parameter ``name`` (a copy, or ``t`` itself).
    A row-parallel layer's bias (OPT's out_proj and fc2) stays whole on rank 0 and is zeros on the
    others: the all-reduce after the layer then adds it once."""
    if plan.world_size == 1:
        return t
    d = plan.head_dim
    kind = name.split(".")[-2] if "." in name else name  # "q_proj" of "model.layers.0.self_attn.q_proj.weight"
    if name in _VOCAB_ROWS:
        return _vocab_rows(t, plan)
    if kind in _HEAD_ROWS:
        start = plan.rank * plan.num_local_heads * d
        return _rows(t, start, start + plan.num_local_heads * d)
    if kind in _KV_HEAD_ROWS:
        start = plan.kv_head_start * d
        return _rows(t, start, start + plan.num_local_kv_heads * d)
    if kind in _INTERMEDIATE_ROWS:
        return _rows(t, *plan.intermediate_range)
    if kind in _HEAD_COLUMNS + _INTERMEDIATE_COLUMNS and not name.endswith(".weight"):
        return t.clone() if plan.rank == 0 else torch.zeros_like(t)
    if kind in _HEAD_COLUMNS:
        start = plan.rank * plan.num_local_heads * d
        return _columns(t, start, start + plan.num_local_heads * d)
    if kind in _INTERMEDIATE_COLUMNS:
        return _columns(t, *plan.intermediate_range)
    return t  # norms, OPT's position embeddings and width projections: replicated


def shard_state_dict(state: dict[str, torch.Tensor], plan: ShardPlan) -> dict[str, torch.Tensor]:
    """Every parameter of a full Hugging Face state dict, cut to rank ``plan.rank``'s slice."""
    return {name: shard_tensor(name, t, plan) for name, t in state.items()}
