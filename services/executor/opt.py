"""OPT (Meta's Open Pre-trained Transformers, the models the PagedAttention paper served) over the
paged KV cache: learned position embeddings, LayerNorm, multi-head attention with biases, a ReLU
MLP (fc1, fc2), the LM head tied to the token embeddings.

Parameter names mirror Hugging Face's ``OPTForCausalLM`` (``model.decoder.layers.N.fc1`` and so on;
checkpoints saved from ``OPTModel``, whose names start at ``decoder.``, are read too), but for the
fused ``qkv_proj`` (``model.fuse_projections``). Computed as transformers computes it: the queries
scaled after their projection (bias included) and attention then unscaled, the 350M's variant with
the norms after each sublayer (``do_layer_norm_before: false``) and its projections between the
embedding and hidden widths (``word_embed_proj_dim``).

Tensor parallelism as for Llama (``parallel/sharding.py``): heads and fc1's rows split over the
ranks, out_proj's and fc2's columns, their biases added by rank 0 only, so that the all-reduce's sum
holds each once; the position embeddings, norms and projections are replicated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from shared.hf_config import ModelShape, model_shape

from .attention import AttentionMetadata, paged_attention
from .model import CausalLM, VocabEmbedding
from .module import Linear, Module
from .parallel.base import Communicator
from .parallel.sharding import ShardPlan

# transformers' ACT2FN names whose torch form is one function here, computed as transformers does
ACTIVATIONS = {"relu": nn.functional.relu, "gelu": nn.functional.gelu}
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which OPT's layers use


@dataclass(frozen=True)
class OPTConfig(ModelShape):
    """The checked sizes plus what OPT's forward pass needs from its transformers config."""

    norm_before: bool  # do_layer_norm_before: pre-norm sublayers (every OPT but the 350M)
    final_norm: bool  # the decoder's final LayerNorm (pre-norm models)
    bias: bool  # enable_bias: biases on every projection and fc1/fc2
    norm_affine: bool  # layer_norm_elementwise_affine
    activation: str

    @classmethod
    def from_hf(cls, hf) -> "OPTConfig":
        activation = getattr(hf, "activation_function", "relu")
        if activation not in ACTIVATIONS:
            raise ValueError(f"OPT activation {activation!r} is not supported ({', '.join(ACTIVATIONS)})")
        shape = model_shape(hf.to_dict(), "model opt")
        norm_before = bool(getattr(hf, "do_layer_norm_before", True))
        return cls(
            **dataclasses.asdict(shape),
            norm_before=norm_before,
            final_norm=norm_before and not getattr(hf, "_remove_final_layer_norm", False),
            bias=bool(getattr(hf, "enable_bias", True)),
            norm_affine=bool(getattr(hf, "layer_norm_elementwise_affine", True)),
            activation=activation,
        )


class LayerNorm(Module, nn.LayerNorm):
    """``nn.LayerNorm``, called as ``Module`` is."""


class LearnedPositions(Module):
    """OPT's position embeddings: row ``position + 2`` of the table (its first two rows are unused,
    a leftover of fairseq's padding offset)."""

    OFFSET = 2

    def __init__(self, max_positions: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_positions + self.OFFSET, dim))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        return nn.functional.embedding(positions + self.OFFSET, self.weight)


class OPTAttention(Module):
    """This rank's heads; q, k and v are one matmul (``qkv_proj``), out_proj's sums all-reduced."""

    def __init__(self, cfg: OPTConfig, plan: ShardPlan, comm: Communicator) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = plan.num_local_heads, plan.num_local_kv_heads
        self.head_dim, self.comm = cfg.head_dim, comm
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.bias)
        self.out_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.bias)
        self.scaling = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, kv_cache, meta: AttentionMetadata, backend) -> torch.Tensor:
        num_tokens, q, kv = x.shape[0], self.q_size, self.kv_size
        qkv = self.qkv_proj(x)
        query = (qkv[:, :q] * self.scaling).view(num_tokens, self.num_heads, self.head_dim)  # as transformers
        key = qkv[:, q:q + kv].reshape(num_tokens, self.num_kv_heads, self.head_dim).contiguous()
        value = qkv[:, q + kv:].reshape(num_tokens, self.num_kv_heads, self.head_dim).contiguous()
        key_cache, value_cache = kv_cache
        backend.write_kv(key_cache, value_cache, key, value, meta.slot_mapping)
        out = paged_attention(backend, query, key_cache, value_cache, meta, 1.0, key, value)
        return self.comm.all_reduce_(self.out_proj(out.view(num_tokens, q)))


class OPTDecoderLayer(Module):
    def __init__(self, cfg: OPTConfig, plan: ShardPlan, comm: Communicator) -> None:
        super().__init__()
        start, stop = plan.intermediate_range
        self.norm_before, self.comm = cfg.norm_before, comm
        self.activation = ACTIVATIONS[cfg.activation]
        self.self_attn = OPTAttention(cfg, plan, comm)
        self.self_attn_layer_norm = LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS, elementwise_affine=cfg.norm_affine)
        self.fc1 = Linear(cfg.hidden_size, stop - start, bias=cfg.bias)
        self.fc2 = Linear(stop - start, cfg.hidden_size, bias=cfg.bias)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS, elementwise_affine=cfg.norm_affine)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce_(self.fc2(self.activation(self.fc1(x))))

    def forward(self, hidden: torch.Tensor, kv_cache, meta: AttentionMetadata, backend) -> torch.Tensor:
        if self.norm_before:
            hidden = hidden + self.self_attn(self.self_attn_layer_norm(hidden), kv_cache, meta, backend)
            return hidden + self.mlp(self.final_layer_norm(hidden))
        hidden = self.self_attn_layer_norm(hidden + self.self_attn(hidden, kv_cache, meta, backend))
        return self.final_layer_norm(hidden + self.mlp(hidden))


class OPTDecoder(Module):
    def __init__(self, cfg: OPTConfig, max_positions: int, plan: ShardPlan, comm: Communicator) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg, plan, comm, dim=cfg.embedding_dim)
        self.embed_positions = LearnedPositions(max_positions, cfg.hidden_size)
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, plan, comm) for _ in range(cfg.num_layers))
        affine = cfg.norm_affine
        self.final_layer_norm = LayerNorm(cfg.hidden_size, eps=LAYER_NORM_EPS, elementwise_affine=affine) \
            if cfg.final_norm else None
        widths_differ = cfg.embedding_dim != cfg.hidden_size
        self.project_in = Linear(cfg.embedding_dim, cfg.hidden_size, bias=False) if widths_differ else None
        self.project_out = Linear(cfg.hidden_size, cfg.embedding_dim, bias=False) if widths_differ else None


class OPTModel(Module):
    def __init__(self, cfg: OPTConfig, max_positions: int, plan: ShardPlan, comm: Communicator) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg, max_positions, plan, comm)


class OPTForCausalLM(CausalLM):
    def __init__(self, cfg: OPTConfig, max_positions: int, plan: ShardPlan | None = None,
                 comm: Communicator | None = None) -> None:
        super().__init__(cfg, plan, comm)
        if max_positions > cfg.max_position_embeddings:
            raise ValueError(f"OPT has {cfg.max_position_embeddings} position embeddings, not {max_positions}")
        # the table holds every position the checkpoint has; sequences stop at max_positions
        self.model = OPTModel(cfg, cfg.max_position_embeddings, self.plan, self.comm)
        self.lm_head = Linear(cfg.embedding_dim, self.plan.vocab_shard_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight
        self._max_positions = max_positions

    @property
    def max_model_len(self) -> int:
        return self._max_positions

    @property
    def input_embeddings(self) -> VocabEmbedding:
        return self.model.decoder.embed_tokens

    @staticmethod
    def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Names of a checkpoint saved from ``OPTModel`` (``decoder.…``) under ``model.``."""
        return {f"model.{k}" if k.startswith("decoder.") else k: v for k, v in state.items()}

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (key_cache, value_cache)
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:  # [T, embedding_dim]
        decoder = self.model.decoder
        hidden = decoder.embed_tokens(input_ids)
        if decoder.project_in is not None:
            hidden = decoder.project_in(hidden)
        hidden = hidden + decoder.embed_positions(positions)
        for layer, kv_cache in zip(decoder.layers, kv_caches):
            hidden = layer(hidden, kv_cache, meta, backend)
        if decoder.final_layer_norm is not None:
            hidden = decoder.final_layer_norm(hidden)
        if decoder.project_out is not None:
            hidden = decoder.project_out(hidden)
        return hidden
