"""A GGUF file's tensors read raw (``--quantization gguf``): the quantized ones kept in their blocks
(``QuantWeight``), the rest as float32 tensors, all under Hugging Face parameter names.

llama.cpp's converter names tensors ``blk.N.attn_q.weight`` and so on and, for the Llama
architecture, permutes the rows of ``attn_q`` / ``attn_k`` for its rope layout; ``transformers``'
GGUF loader undoes that (``reverse_permute_weights``), and so does ``_unpermute`` here: a row
permutation, which keeps every block whole (GGUF blocks run along the input dimension).

A tensor of a type the kernels do not serve (``SERVED_TYPES``) is dequantized by the ``gguf``
package and served in the model's dtype; ``read_gguf`` reports it in ``GGUFRead.dequantized``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import structlog
import torch

from kernels.quant_reference import TYPES

SERVED_TYPES = {t: name for t, (name, _, _) in TYPES.items()}
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")  # the decoder families whose names map below
_PERMUTED = ("llama", "mistral")  # llama.cpp permutes their q/k rows
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
log = structlog.get_logger()


class QuantizationChoice(NamedTuple):
    mode: str  # "gguf" (served in their blocks), "int8" (quantized at load) or "none" (as they are)
    reason: str


def gguf_path(source) -> str | None:
    """The GGUF file a ``ModelSource`` was read from, or None for a Hugging Face directory."""
    if source.converted_from:
        return source.converted_from
    return os.path.join(source.directory, source.gguf_file) if source.gguf_file else None


# Measured with ``python -m loadtest.bench.quantized`` (2-core Intel Xeon, AMX; docs/benchmarks.md): the
# embedded SmolLM2 served in its Q4_1 blocks decoded one stream 1.6x faster than dequantized to
# bfloat16, but 16 streams at 0.43x and 64 at 0.26x. A server batches, so auto dequantizes.
AUTO_REASON = ("--quantization auto on a GGUF file: dequantized (in its blocks one stream decodes faster but a "
               "batch much slower, measured; --quantization gguf keeps them, at 0.3x the weight memory)")


def choose_quantization(requested: str, is_gguf: bool, model_type: str, device_type: str = "cpu") -> QuantizationChoice:
    """What ``--quantization requested`` serves for a model (a GGUF file or not, of ``model_type``,
    on a ``device_type`` device)."""
    if requested == "none":
        return QuantizationChoice("none", "--quantization none: every weight dequantized")
    if requested == "int8":
        if device_type != "cpu" or model_type == "opt":
            return QuantizationChoice("none", f"--quantization int8 on {model_type if device_type == 'cpu' else device_type}: "
                                              "not served in int8 (CPU kernels, decoder families), weights as they are")
        return QuantizationChoice("int8", "--quantization int8: every matmul and the embeddings quantized at load "
                                          "to int8 with a scale per output channel (int8_weights.py)")
    if not is_gguf:
        return QuantizationChoice("none", f"--quantization {requested} on a Hugging Face checkpoint: its weights as "
                                          "they are")
    if requested == "auto":
        return QuantizationChoice("none", AUTO_REASON)
    if device_type != "cpu":
        return QuantizationChoice("none", f"--quantization gguf on {device_type}: the quantized kernels are CPU "
                                          "kernels, so the GGUF file is dequantized")
    if model_type not in ARCHITECTURES:
        return QuantizationChoice("none", f"--quantization gguf: {model_type} GGUF files are dequantized "
                                          f"(served quantized: {', '.join(ARCHITECTURES)})")
    return QuantizationChoice("gguf", "--quantization gguf on a GGUF file: its Q8_0/Q4_0/Q4_1/Q4_K/Q6_K "
                                      "matrices stay in their blocks, the matmuls read them")


@dataclass
class QuantWeight:
    """One weight ``[out, in]`` in its GGUF blocks: ``raw`` uint8 ``[out, row bytes]``."""

    raw: torch.Tensor
    ggml_type: int
    in_features: int

    @property
    def type_name(self) -> str:
        return SERVED_TYPES[self.ggml_type]

    @property
    def block(self) -> int:
        return TYPES[self.ggml_type][1]


@dataclass
class GGUFRead:
    state: dict  # HF name -> torch.Tensor (float32) or QuantWeight
    architecture: str
    dequantized: dict[str, str] = field(default_factory=dict)  # HF name -> type it had

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.state.values():
            name = t.type_name if isinstance(t, QuantWeight) else "float"
            counts[name] = counts.get(name, 0) + 1
        return counts


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name, or None for one this map does not know."""
    if name in _TOP:
        return _TOP[name]
    m = _BLK.match(name)
    if m is None or m.group(2) not in _LAYER:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def _unpermute(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """transformers' ``reverse_permute_weights`` on the rows of ``t`` (float or raw blocks)."""
    dim = t.shape[0] // n_head // 2
    return t.reshape(n_head, dim, 2, *t.shape[1:]).swapaxes(2, 1).reshape(t.shape).contiguous()


def _tensor(t, name: str, read: GGUFRead):
    from gguf.quants import dequantize

    data = np.asarray(t.data)
    if int(t.tensor_type) in SERVED_TYPES and data.ndim == 2:
        return QuantWeight(torch.from_numpy(data.copy()), int(t.tensor_type), int(t.shape[0]))
    if t.tensor_type.name not in ("F32", "F16", "BF16"):
        read.dequantized[name] = t.tensor_type.name
    return torch.from_numpy(np.array(dequantize(data, t.tensor_type), dtype=np.float32))


def read_gguf(path: str, hf_config) -> GGUFRead:
    """Every tensor of the GGUF file ``path`` (a model of ``hf_config``) under its HF name; raises
    ValueError (one line) for an architecture or a tensor name this reader does not map."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - a truncated or corrupt file, in one line
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {str(exc)[:160]})") from exc
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not served quantized (only {', '.join(ARCHITECTURES)})")
    read = GGUFRead({}, arch)
    heads = {"self_attn.q_proj": hf_config.num_attention_heads,
             "self_attn.k_proj": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ValueError(f"GGUF tensor {t.name} has no counterpart in the {arch} model")
        value = _tensor(t, name, read)
        part = next((p for p in heads if f".{p}." in name), None)
        if arch in _PERMUTED and part is not None:
            if isinstance(value, QuantWeight):
                value.raw = _unpermute(value.raw, heads[part])
            else:
                value = _unpermute(value, heads[part])
        read.state[name] = value
    for name, kind in read.dequantized.items():
        log.info("gguf tensor dequantized", tensor=name, type=kind, why="no quantized kernel for its type")
    return read
