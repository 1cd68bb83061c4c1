"""The decoder layer's parts around attention and the matmuls, shared by every family: the
residual add + RMS norm (and the plain norm of Gemma's sandwich norms and of Qwen3's and Gemma 3's
query and key heads), the rotary embedding (with the q/k/v split; linear scaling) and the gated
MLP (SiLU, or Gemma's tanh-approximated GELU).

Each runs its elementwise chain in one kernel where the attention backend offers one for these
tensors (the numba backend on CPU: ``add_rms_norm``, ``rope_split``, ``silu_mul``;
``kernels/cpu/``), else as the torch form written here, which rounds as Hugging Face's modules do.
In a decode-only step the numba backend rotates inside its fused decode instead, bit for bit the
same (``decode_from_qkv`` in ``attention.py``).
Float32 with ``nn.Linear`` weights (``--linear-kernel auto``'s float32) is the exactness mode, in
which greedy output equals transformers' token for token: there the rotary kernel is bit for bit
the torch form, the norm kernel's variance may differ by an ulp (its sum of squares runs in another
order; ``kernels/cpu/norm.py``), and the MLP runs transformers' own ops (``MLP``; the fused
activation kernel would move about half its float32 elements by an ulp or more).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .module import Linear, Module
from .parallel.base import Communicator
from .parallel.sharding import ShardPlan
from .rope import Rope, cos_sin, plain_rope

if TYPE_CHECKING:
    from .decoder import ModelConfig


class RMSNorm(Module):
    """``forward(delta, residual)``: ``residual += delta`` in place (the residual stream; ``delta``
    may have no rows), then ``(RMSNorm(residual), residual)``: a decoder layer's "sublayer output
    plus residual, then norm". In one kernel where the attention backend has one for these tensors
    (``add_rms_norm``: the numba backend on CPU), else in torch, as Hugging Face's."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, delta: torch.Tensor, residual: torch.Tensor, backend=None) -> tuple[torch.Tensor, torch.Tensor]:
        fused = getattr(backend, "add_rms_norm", None)
        out = fused(residual, delta, self.weight, self.eps) if fused else None
        if out is not None:
            return out, residual
        if delta.shape[0]:
            residual.add_(delta)
        dtype = residual.dtype
        x = residual.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype), residual

    def normalize(self, x: torch.Tensor, backend=None) -> torch.Tensor:
        """RMSNorm(x) alone, as Hugging Face's (no residual): Gemma's norms of a sublayer's output;
        ``forward`` with nothing to add (``x`` is left as it is)."""
        return self.forward(x[:0], x, backend)[0]


class HeadNorm(RMSNorm):
    """The RMS norm of each query or key head over its ``head_dim`` (Qwen3's ``q_norm`` and
    ``k_norm``, Gemma 3's), written back into the fused projection's output (``apply_``)."""

    def apply_(self, heads: torch.Tensor) -> None:  # [T, H, D], a view into the q/k/v output
        heads.copy_(self.normalize(heads))


def head_norms_(qkv: torch.Tensor, q_norm: HeadNorm, k_norm: HeadNorm, num_heads: int, num_kv_heads: int,
                backend=None) -> None:
    """The query and key heads of a fused q/k/v output ``[T, (H + 2 Hkv) D]`` normalized in place:
    in one kernel where the backend has one for these tensors (``head_rms_norm``: the numba
    backend on CPU), else ``HeadNorm``'s torch form on each part."""
    fused = getattr(backend, "head_rms_norm", None)
    if fused is not None and fused(qkv, q_norm.weight, k_norm.weight, q_norm.eps, num_heads, num_kv_heads):
        return
    num_tokens, head_dim = qkv.shape[0], q_norm.weight.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q_norm.apply_(qkv[:, :q_size].view(num_tokens, num_heads, head_dim))
    k_norm.apply_(qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim))

class RotaryEmbedding(Module):
    """Non-interleaved (``rotate_half``) rotary embedding with a precomputed cos/sin table of a
    ``Rope`` (``rope.py``; a float theta: the plain table of that base). Where the table is
    narrower than a head (``partial_rotary_factor``), only the head's first channels turn."""

    def __init__(self, head_dim: int, max_positions: int, rope: Rope | float) -> None:
        super().__init__()
        # Computed on the CPU even where the model is built on the meta device (``build_model``
        # replaces this table after): meta tensors run torch's Python reference ops, whose first
        # use imports torch._dynamo (about 1 s of every executor's start here).
        rope = plain_rope(head_dim, rope) if isinstance(rope, (int, float)) else rope
        cos, sin = cos_sin(rope, max_positions)  # [max_positions, rotary_dim]
        self.head_dim = head_dim
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @property
    def partial(self) -> bool:
        return self.cos.shape[-1] < self.head_dim

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, rotary_dim]`` of ``positions`` ``[T]`` in ``dtype`` (as transformers
        casts them): looked up once per forward pass, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                num_kv_heads: int, backend=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv``: a fused projection's output ``[T, (H + 2 Hkv) * D]``; cos and sin ``[T, 1, R]``.
        Returns new contiguous rotated queries ``[T, H, D]``, rotated keys and values
        ``[T, Hkv, D]``: in one kernel where the attention backend has one for these tensors
        (``rope_split``: the numba backend on CPU, bit for bit the same; whole heads only), else as below."""
        fused = None if cos.shape[-1] < self.head_dim else getattr(backend, "rope_split", None)
        out = fused(qkv, cos, sin, num_heads, num_kv_heads) if fused else None
        if out is not None:
            return out
        num_tokens, head_dim, turned = qkv.shape[0], self.head_dim, cos.shape[-1]
        qk_size = (num_heads + num_kv_heads) * head_dim
        # queries and keys are adjacent: rotated together, into a new [T, H + Hkv, D]
        x = qkv[:, :qk_size].view(num_tokens, num_heads + num_kv_heads, head_dim)
        if turned < head_dim:  # as transformers: the first ``turned`` channels rotated, the rest kept
            x_rot = x[..., :turned]
            qk = torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x[..., turned:]), dim=-1)
        else:
            qk = x * cos + _rotate_half(x) * sin
        v = qkv[:, qk_size:].reshape(num_tokens, num_kv_heads, head_dim)
        return qk[:, :num_heads].contiguous(), qk[:, num_heads:].contiguous(), v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh")  # transformers' gelu_pytorch_tanh


# transformers' ACT2FN names of the gated MLP's activation, computed as transformers computes them
ACTIVATIONS = {"silu": nn.functional.silu, "gelu_pytorch_tanh": _gelu_tanh}


class MLP(Module):
    """This rank's intermediate columns; down_proj's partial sums are all-reduced.

    gate and up are one matmul: ``gate_up_proj`` holds this rank's rows of Hugging Face's gate_proj
    then up_proj (``fuse_projections``); ``silu(gate) * up`` is then one kernel pass over its
    output. Measured against two matmuls and torch's ``silu`` and ``mul`` (SmolLM2's 30 MLPs at 64
    rows, oneDNN-packed, 2-core AMD EPYC Zen 5, loaded, median of 21): bfloat16 22.3 -> 18.1 ms,
    float32 37.0 -> 32.2 ms; the fused matmul alone gains little (float32 33.8 -> 32.5 ms). At 544
    rows (a prefill) it is a tie (bfloat16 100.2 -> 101.0 ms).

    In float32 on ``nn.Linear`` (the exactness mode) it computes what transformers' ``LlamaMLP``
    does, op for op: two matmuls over the halves of the weight (``separate_gate_up``: at some
    shapes the fused matmul sums in another order), torch's ``silu`` and ``mul``."""

    def __init__(self, cfg: ModelConfig, plan: ShardPlan, comm: Communicator) -> None:
        super().__init__()
        start, stop = plan.intermediate_range
        self.num_columns, self.comm = stop - start, comm
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.num_columns, bias=False)
        self.down_proj = Linear(self.num_columns, cfg.hidden_size, bias=False)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"MLP activation {cfg.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.fused_silu = cfg.hidden_act == "silu"  # the backend's silu_mul kernel, else its gelu_tanh_mul

    def forward(self, x: torch.Tensor, backend=None) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.as_transformers(x.dtype):
            gate, up = self.separate_gate_up(x)
            y = self.act(gate) * up
        else:
            y = self.activation(self.gate_up_proj(x), backend)
        return self.comm.all_reduce_(self.down_proj(y))

    def as_transformers(self, dtype: torch.dtype) -> bool:
        """Whether inputs of ``dtype`` take transformers' ops (the float32 exactness mode) rather
        than the fused matmul and ``activation``."""
        return dtype == torch.float32 and isinstance(self.gate_up_proj, nn.Linear)

    def separate_gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [T, I]
        """gate_proj(x) and up_proj(x) as transformers computes them: one ``F.linear`` each."""
        gate, up = self.gate_up_proj.weight.split(self.num_columns)
        return nn.functional.linear(x, gate), nn.functional.linear(x, up)

    def activation(self, gate_up: torch.Tensor, backend=None) -> torch.Tensor:  # [T, 2 I] -> [T, I]
        """``silu(gate) * up`` of the fused output: one kernel where the backend has one for it
        (``silu_mul``: the numba backend on CPU), else torch's ``silu`` and ``mul``."""
        fused = getattr(backend, "silu_mul" if self.fused_silu else "gelu_tanh_mul", None)
        out = fused(gate_up) if fused else None
        if out is not None:
            return out
        gate, up = gate_up.split(self.num_columns, dim=-1)
        return self.act(gate) * up
