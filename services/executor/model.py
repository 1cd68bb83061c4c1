"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Parameter names mirror Hugging Face's, but for the fused ``qkv_proj`` and ``gate_up_proj`` (one
matmul each), which ``fuse_projections`` joins from Hugging Face's parts at load. The forward pass
works on a flat batch: all scheduled tokens of all sequences concatenated (``[T]``), with
positions, and an ``AttentionMetadata`` saying which rows belong to which sequence and where their
keys go. The norms, the rotary embedding and the MLP live in ``layers.py``.

Tensor parallelism: built with a ``ShardPlan`` and a communicator, a model holds only its rank's
slice of each layer (``parallel/sharding.py`` says which) and every rank runs the same forward
pass: the row-parallel o_proj and down_proj and the vocabulary-split embedding end in an
all-reduce, and ``compute_logits`` gathers the vocabulary shards on rank 0 (``None`` elsewhere).
Without a plan it is the whole model on one rank, and the collectives are identities.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from shared.hf_config import ModelShape, model_shape

from .attention import AttentionMetadata, decode_from_qkv, paged_attention
from .layers import MLP, RMSNorm, RotaryEmbedding
from .module import Linear, Module
from .parallel.base import Communicator, SingleRank
from .parallel.sharding import ShardPlan


@dataclass(frozen=True)
class ModelConfig(ModelShape):
    """The checked sizes (``shared.hf_config.ModelShape``) plus what the forward pass needs."""

    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """Build from a transformers config (v4 ``rope_theta`` or v5 ``rope_parameters``); the sizes
        are read and checked by ``model_shape``, as every process reads them."""
        if hf.model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"model type {hf.model_type!r} is not supported (llama, mistral, qwen2)")
        rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope type {rope_type!r} is not supported yet")
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        shape = model_shape(hf.to_dict(), f"model {hf.model_type}")
        return cls(
            **dataclasses.asdict(shape),
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            attention_bias=bool(getattr(hf, "attention_bias", False)) or hf.model_type == "qwen2",
        )


class Attention(Module):
    """This rank's query heads and the KV heads they use; o_proj's partial sums are all-reduced.

    q, k and v are one matmul: ``qkv_proj`` holds this rank's rows of Hugging Face's q_proj,
    k_proj and v_proj one after the other (``fuse_projections``)."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, comm: Communicator) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = plan.num_local_heads, plan.num_local_kv_heads
        self.head_dim, self.comm = cfg.head_dim, comm
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], rotary, kv_cache, meta: AttentionMetadata,
                backend):
        # x: [T, hidden]; rope: cos and sin [T, 1, D] (``RotaryEmbedding.at``)
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        key_cache, value_cache = kv_cache
        out = decode_from_qkv(backend, qkv, rope, key_cache, value_cache, meta, self.scale, self.num_heads)
        if out is None:
            q, k, v = rotary(qkv, *rope, self.num_heads, self.num_kv_heads, backend)
            backend.write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
            out = paged_attention(backend, q, key_cache, value_cache, meta, self.scale, k, v)
        return self.comm.all_reduce_(self.o_proj(out.view(num_tokens, self.q_size)))


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

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, comm: Communicator, dim: int | None = None) -> None:
        super().__init__()  # dim: the embeddings' width (default the hidden size)
        self.weight = nn.Parameter(torch.empty(plan.vocab_shard_size, dim or cfg.hidden_size))
        self.vocab_range, self.comm = plan.vocab_range, comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.comm.world_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        start, stop = self.vocab_range
        outside = (input_ids < start) | (input_ids >= stop)
        x = nn.functional.embedding((input_ids - start).masked_fill_(outside, 0), self.weight)
        return self.comm.all_reduce_(x.masked_fill_(outside.unsqueeze(-1), 0.0))


class DecoderLayer(Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, comm: Communicator) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, plan, comm)
        self.mlp = MLP(cfg, plan, comm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, delta, residual, rope, rotary, kv_cache, meta, backend):
        """``delta``: the previous layer's MLP output (no rows before the first layer), added to
        the residual stream by this layer's first norm; returns (this MLP's output, the stream)."""
        x, residual = self.input_layernorm(delta, residual, backend)
        x, residual = self.post_attention_layernorm(
            self.self_attn(x, rope, rotary, kv_cache, meta, backend), residual, backend)
        return self.mlp(x, backend), residual


class LlamaModel(Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, comm: Communicator) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg, plan, comm)
        self.layers = nn.ModuleList(DecoderLayer(cfg, plan, comm) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(Module):
    """What the runner, the loader and the tensor-parallel group use of a model, whatever its family
    (``LlamaForCausalLM`` here, ``OPTForCausalLM`` in ``opt.py``): its config, shard plan and
    communicator, the KV pool's shape, the LM head's logits, the longest sequence it was built for.

    A family's class sets ``config_class`` (with a ``from_hf(transformers config)``), builds its
    layers, an ``lm_head`` and ``input_embeddings`` (a ``VocabEmbedding``), and defines
    ``forward(input_ids, positions, kv_caches, meta, backend)``; ``hf_state_dict`` maps a
    checkpoint's names onto its parameters' and ``build_buffers`` makes what is computed rather than
    loaded."""

    config_class: type

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


class LlamaForCausalLM(CausalLM):
    config_class = ModelConfig

    def __init__(self, cfg: ModelConfig, max_positions: int, plan: ShardPlan | None = None,
                 comm: Communicator | None = None) -> None:
        super().__init__(cfg, plan, comm)
        self.model = LlamaModel(cfg, self.plan, self.comm)
        self.lm_head = Linear(cfg.hidden_size, self.plan.vocab_shard_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta)

    @property
    def max_model_len(self) -> int:
        return self.rotary.cos.shape[0]  # the rotary table's positions

    @property
    def input_embeddings(self) -> "VocabEmbedding":
        return self.model.embed_tokens

    @staticmethod
    def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in state.items() if "rotary_emb" not in k}  # computed, not loaded

    def build_buffers(self, max_model_len: int, device: torch.device) -> None:
        # float32 whatever the weights are (``RotaryEmbedding.at`` casts per pass)
        self.rotary = RotaryEmbedding(self.config.head_dim, max_model_len, self.config.rope_theta).to(device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (key_cache, value_cache)
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:  # [T, hidden]
        residual = self.model.embed_tokens(input_ids)  # the residual stream, summed in place
        rope = self.rotary.at(positions, residual.dtype)
        for_pass = getattr(backend, "for_pass", None)  # what the layers' calls share, made once
        if for_pass is not None:
            backend = for_pass(meta, rope, residual.shape[0], residual.dtype)
        delta = residual[:0]
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            delta, residual = layer(delta, residual, rope, self.rotary, kv_cache, meta, backend)
        return self.model.norm(delta, residual, backend)[0]

