"""What every model family shares: ``CausalLM``, the interface the runner, the loader and the
tensor-parallel group use of a model (the decoder of ``decoder.py``, OPT in ``opt.py``); the
vocabulary-split token embedding; and ``fuse_projections``, which joins a checkpoint's q/k/v and
gate/up weights into the fused matmuls the families' layers run.

Tensor parallelism: built with a ``ShardPlan`` and a communicator, a model holds only its rank's
slice of each layer (``parallel/sharding.py`` says which); ``compute_logits`` gathers the
vocabulary shards on rank 0 (``None`` elsewhere). Without a plan it is the whole model on one rank,
and the collectives are identities.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .module import Module
from .parallel.base import Communicator, SingleRank
from .parallel.sharding import ShardPlan


# Hugging Face's separate projections -> (our fused parameter, its parts in order)
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with Hugging Face names (whole, or already cut to one rank's slices by
    ``shard_state_dict``) with each layer's q/k/v weights (and biases) concatenated into
    ``qkv_proj`` and its gate/up weights into ``gate_up_proj`` (``FUSED_PROJECTIONS``); every
    other entry as it was. Parts missing from
    ``state`` stay as they are (``load_state_dict`` then reports them)."""
    out = dict(state)
    for name in state:
        for fused, parts in FUSED_PROJECTIONS.items():
            prefix, _, kind = name.partition(parts[0] + ".")
            if not kind or not prefix.startswith(("model.layers.", "model.decoder.layers.")):  # (OPT's)
                continue
            names = [f"{prefix}{part}.{kind}" for part in parts]
            if all(n in state for n in names):
                out[f"{prefix}{fused}.{kind}"] = torch.cat([state[n] for n in names])
                for n in names:
                    del out[n]
    return out


class VocabEmbedding(Module):
    """This rank's rows of the embedding; ids outside them embed to zeros, then an all-reduce."""

    def __init__(self, cfg, plan: ShardPlan, comm: Communicator, dim: int | None = None) -> None:
        super().__init__()  # dim: the embeddings' width (default the hidden size)
        self.weight = nn.Parameter(torch.empty(plan.vocab_shard_size, dim or cfg.hidden_size))
        self.vocab_range, self.comm = plan.vocab_range, comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.comm.world_size == 1:
            return self.lookup(input_ids)
        start, stop = self.vocab_range
        outside = (input_ids < start) | (input_ids >= stop)
        x = self.lookup((input_ids - start).masked_fill_(outside, 0))
        return self.comm.all_reduce_(x.masked_fill_(outside.unsqueeze(-1), 0.0))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:  # this shard's rows (quantized.py: from blocks)
        return nn.functional.embedding(ids, self.weight)


class CausalLM(Module):
    """What the runner, the loader and the tensor-parallel group use of a model, whatever its family
    (``DecoderForCausalLM`` in ``decoder.py``, ``OPTForCausalLM`` in ``opt.py``): its config, shard plan and
    communicator, the KV pool's shape, the LM head's logits, the longest sequence it was built for.

    A model class is built from the config its family's file reads (``families/``), builds its
    layers, an ``lm_head`` and ``input_embeddings`` (a ``VocabEmbedding``), and defines
    ``forward(input_ids, positions, kv_caches, meta, backend)``; ``hf_state_dict`` maps a
    checkpoint's names onto its parameters' and ``build_buffers`` makes what is computed rather than
    loaded."""

    def __init__(self, cfg, plan: ShardPlan | None, comm: Communicator | None) -> None:
        super().__init__()
        plan = plan or ShardPlan.for_model(cfg)
        comm = comm or SingleRank()
        if (comm.rank, comm.world_size) != (plan.rank, plan.world_size):
            raise ValueError(f"shard plan of rank {plan.rank}/{plan.world_size} with a communicator of "
                             f"rank {comm.rank}/{comm.world_size}")
        self.config, self.plan, self.comm = cfg, plan, comm

    @property
    def kv_cache_config(self):
        """The config to size and allocate this rank's KV pool from: only its KV heads."""
        return dataclasses.replace(self.config, num_kv_heads=self.plan.num_local_kv_heads)

    @property
    def max_model_len(self) -> int:
        """The most positions a sequence may reach in this model as built."""
        raise NotImplementedError

    @property
    def input_embeddings(self) -> "VocabEmbedding":
        raise NotImplementedError

    @property
    def freeable_window(self) -> int:
        """The sliding window (tokens) of every layer, when all have one: a KV block whose tokens
        all left it is attended by no layer any more (the scheduler frees it); 0: none."""
        return 0

    @staticmethod
    def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors under this model's Hugging Face names (before sharding and fusing),
        in a new dict."""
        return dict(state)

    def build_buffers(self, max_model_len: int, device: torch.device) -> None:
        """Make the tables that are computed, not loaded, on ``device`` (after the weights are cast)."""

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [N, hidden] -> [N, vocab]
        """Every rank must call it; rank 0 gets the logits, the other ranks ``None``. The logits
        stay in the model's dtype, as transformers' LM head returns them: their readers widen them
        to float32 where they compute with them (an exact cast), and greedy sampling needs no copy
        (at 64 rows of SmolLM2 in bfloat16 the cast took 0.5 ms, a fresh 12.6 MB)."""
        logits = self.lm_head(hidden)  # [N, vocab_shard_size]
        if self.comm.world_size == 1:
            return logits
        shards = self.comm.gather(logits, dst=0)
        return None if shards is None else torch.cat(shards, dim=-1)[:, : self.config.vocab_size]
