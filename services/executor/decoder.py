"""The decoder every Llama-like family runs (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2
and 3) over a paged KV cache, configured by ``ModelConfig``'s knobs: what differs between the
families is read from their transformers configs by their own small files in ``families/``.

Parameter names mirror Hugging Face's, but for the fused ``qkv_proj`` and ``gate_up_proj`` (one
matmul each), which ``model.fuse_projections`` joins from Hugging Face's parts at load. The forward
pass works on a flat batch: all scheduled tokens of all sequences concatenated (``[T]``), with
positions, and an ``AttentionMetadata`` saying which rows belong to which sequence and where their
keys go. The norms, the rotary embedding and the MLP live in ``layers.py``.

Tensor parallelism: built with a ``ShardPlan`` and a communicator, a model holds only its rank's
slice of each layer (``parallel/sharding.py`` says which) and every rank runs the same forward
pass: the row-parallel o_proj and down_proj and the vocabulary-split embedding end in an
all-reduce, and ``compute_logits`` gathers the vocabulary shards on rank 0 (``None`` elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shared.hf_config import ModelShape

from .attention import AttentionMetadata, decode_from_qkv, paged_attention
from .layers import MLP, HeadNorm, RMSNorm, RotaryEmbedding, head_norms_
from .model import CausalLM, VocabEmbedding
from .module import Linear, Module
from .parallel.base import Communicator
from .parallel.sharding import ShardPlan
from .rope import Rope


@dataclass(frozen=True)
class ModelConfig(ModelShape):
    """The checked sizes (``shared.hf_config.ModelShape``) plus what the forward pass needs; the
    defaults are Llama's. ``families/`` fills it from a transformers config."""

    rms_norm_eps: float
    rope: Rope  # the rotary frequencies (of the full-attention layers where windowed ones have their own)
    attention_bias: bool
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMS norm of each query and key head before the rotary embedding
    sandwich_norms: bool = False  # Gemma 2, 3: norms after attention and after the MLP, before each residual add
    hidden_act: str = "silu"  # the gated MLP's activation ("gelu_pytorch_tanh": Gemma)
    embedding_scale: float = 1.0  # Gemma: the token embeddings times sqrt(hidden_size)
    query_scale: float | None = None  # the attention's scale; None: head_dim ** -0.5
    attn_softcap: float = 0.0  # Gemma 2: scores capped to (-c, c) by c * tanh(score / c); 0: none
    final_softcap: float = 0.0  # Gemma 2: the logits capped the same way
    layer_windows: tuple[int, ...] = ()  # per layer, its sliding window in tokens (0: full); (): all full
    local_rope: Rope | None = None  # the windowed layers' own rotary table (Gemma 3); None: ``rope``

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def uniform_window(self) -> int:
        """The window of every layer when all have the same one (0 otherwise): then a block all of
        whose tokens left it is attended by no layer, and the scheduler may free it."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else 0


class Attention(Module):
    """This rank's query heads and the KV heads they use; o_proj's partial sums are all-reduced.

    q, k and v are one matmul: ``qkv_proj`` holds this rank's rows of Hugging Face's q_proj,
    k_proj and v_proj one after the other (``fuse_projections``). With ``qk_norm`` each query and
    key head is normalized in place in that output before the rotary embedding, as Qwen3's and
    Gemma 3's attention does."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, comm: Communicator, window: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = plan.num_local_heads, plan.num_local_kv_heads
        self.head_dim, self.comm = cfg.head_dim, comm
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.query_scale if cfg.query_scale is not None else cfg.head_dim**-0.5
        # the kernels' sliding window and soft-cap, passed only where set (the calls stay as Llama's)
        self.window_softcap = {"window": window, "softcap": cfg.attn_softcap} if window or cfg.attn_softcap else {}
        if cfg.qk_norm:
            self.q_norm = HeadNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = HeadNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], rotary, kv_cache, meta: AttentionMetadata,
                backend):
        # x: [T, hidden]; rope: cos and sin [T, 1, D] (``RotaryEmbedding.at``)
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if hasattr(self, "q_norm"):
            head_norms_(qkv, self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads, backend)
        key_cache, value_cache = kv_cache
        extra = self.window_softcap
        out = None if rotary.partial else decode_from_qkv(backend, qkv, rope, key_cache, value_cache, meta,
                                                          self.scale, self.num_heads, **extra)
        if out is None:
            q, k, v = rotary(qkv, *rope, self.num_heads, self.num_kv_heads, backend)
            backend.write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
            out = paged_attention(backend, q, key_cache, value_cache, meta, self.scale, k, v, **extra)
        return self.comm.all_reduce_(self.o_proj(out.view(num_tokens, self.q_size)))


class DecoderLayer(Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, comm: Communicator, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, plan, comm, cfg.window(index))
        self.mlp = MLP(cfg, plan, comm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:  # Gemma's names: post_attention_layernorm then norms the attention's output
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, delta, residual, rope, rotary, kv_cache, meta, backend):
        """``delta``: the previous layer's MLP output (no rows before the first layer), added to
        the residual stream by this layer's first norm; returns (this MLP's output, the stream)."""
        x, residual = self.input_layernorm(delta, residual, backend)
        attn = self.self_attn(x, rope, rotary, kv_cache, meta, backend)
        if not self.sandwich:
            x, residual = self.post_attention_layernorm(attn, residual, backend)
            return self.mlp(x, backend), residual
        attn = self.post_attention_layernorm.normalize(attn, backend)
        x, residual = self.pre_feedforward_layernorm(attn, residual, backend)
        return self.post_feedforward_layernorm.normalize(self.mlp(x, backend), backend), residual


class DecoderModel(Module):
    def __init__(self, cfg: ModelConfig, plan: ShardPlan, comm: Communicator) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg, plan, comm)
        self.layers = nn.ModuleList(DecoderLayer(cfg, plan, comm, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderForCausalLM(CausalLM):

    def __init__(self, cfg: ModelConfig, max_positions: int, plan: ShardPlan | None = None,
                 comm: Communicator | None = None) -> None:
        super().__init__(cfg, plan, comm)
        self.model = DecoderModel(cfg, self.plan, self.comm)
        self.lm_head = Linear(cfg.hidden_size, self.plan.vocab_shard_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.build_buffers(max_positions, torch.device("cpu"))

    @property
    def max_model_len(self) -> int:
        return self.rotary.cos.shape[0]  # the rotary table's positions

    @property
    def input_embeddings(self) -> VocabEmbedding:
        return self.model.embed_tokens

    @property
    def freeable_window(self) -> int:
        return self.config.uniform_window

    @staticmethod
    def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in state.items() if "rotary_emb" not in k}  # computed, not loaded

    def build_buffers(self, max_model_len: int, device: torch.device) -> None:
        # float32 whatever the weights are (``RotaryEmbedding.at`` casts per pass); the windowed
        # layers' own table where their base differs (Gemma 3), else the one table
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, max_model_len, cfg.rope).to(device)
        local = cfg.local_rope
        self.local_rotary = RotaryEmbedding(cfg.head_dim, max_model_len, local).to(device) if local else None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (key_cache, value_cache)
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:  # [T, hidden]
        cfg = self.config
        residual = self.model.embed_tokens(input_ids)  # the residual stream, summed in place
        if cfg.embedding_scale != 1.0:  # as Gemma's: the scale in the stream's dtype
            residual.mul_(torch.tensor(cfg.embedding_scale, dtype=residual.dtype))
        rope = self.rotary.at(positions, residual.dtype)
        local_rope = self.local_rotary.at(positions, residual.dtype) if self.local_rotary is not None else rope
        for_pass = getattr(backend, "for_pass", None)  # what the layers' calls share, made once
        if for_pass is not None:
            backend = for_pass(meta, rope, residual.shape[0], residual.dtype)
        delta = residual[:0]
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            layer_rope = local_rope if cfg.window(i) else rope
            delta, residual = layer(delta, residual, layer_rope, self.rotary, kv_cache, meta, backend)
        return self.model.norm(delta, residual, backend)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.config.final_softcap
        if logits is None or not cap:
            return logits
        if logits.dtype == torch.float32 or not logits.is_cpu or not logits.is_contiguous():
            return torch.tanh(logits / cap) * cap  # Gemma 2's final soft-capping, op for op (exactness mode)
        from kernels.cpu.activation import softcap_  # one pass for 16-bit logits

        return softcap_(logits, cap)
