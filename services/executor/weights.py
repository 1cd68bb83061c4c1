"""Load a model's config and weights from disk (safetensors directory or GGUF file) into our model.

GGUF files are read and dequantized by ``transformers`` (it needs the ``gguf`` package), which also
undoes llama.cpp's Q/K permutation, so the resulting state dict has Hugging Face names and layout.
"""

from __future__ import annotations

import glob
import os
from typing import NamedTuple

import torch

from shared.cpu_features import choose_cpu_dtype, read_cpu_features
from shared.hf_config import load_hf_config as checked_hf_config
from shared.hub_kernels import hide_hub_kernels
from shared.model_source import ModelSource

from .architectures import family
from .model import FUSED_PROJECTIONS, CausalLM, fuse_projections
from .parallel.sharding import ShardPlan, shard_state_dict
from .int8_weights import install_int8, quantize_state_int8, split_int8
from .quantized import fused_names, install_quantized, take_quantized

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DtypeChoice(NamedTuple):
    dtype: torch.dtype
    reason: str
    cpu: dict  # what was detected on a CPU device (``CpuFeatures.summary``), for the log


def resolve_dtype(name: str, device: torch.device) -> DtypeChoice:
    """``auto`` is bfloat16 on GPUs that compute in it (compute capability 8.0 and up; float16 on
    older ones) and on CPUs whose matmuls run bf16 natively (AMX or AVX-512 BF16,
    ``shared/cpu_features.py``), float32 on other CPUs; any other name is taken as is."""
    if name not in ("auto", *_DTYPES):
        raise ValueError(f"--dtype must be auto, {', '.join(_DTYPES)}; got {name!r}")
    if name != "auto":
        return DtypeChoice(_DTYPES[name], f"--dtype {name}", {})
    if (device.type == "cuda" and torch.cuda.is_available()
            and not torch.cuda.is_bf16_supported(including_emulation=False)):
        return DtypeChoice(torch.float16, "--dtype auto on a GPU without bfloat16 arithmetic", {})
    if device.type != "cpu":
        return DtypeChoice(torch.bfloat16, f"--dtype auto on {device.type}", {})
    features = read_cpu_features()
    chosen, reason = choose_cpu_dtype(features)
    return DtypeChoice(_DTYPES[chosen], reason, features.summary())


def load_hf_config(source: ModelSource):
    """The model's transformers config, checked first (one-line errors; see ``shared.hf_config``)."""
    return checked_hf_config(source)


def load_state_dict(source: ModelSource, quantization: str = "none", hf_config=None) -> dict[str, torch.Tensor]:
    """Read every weight of ``source`` into CPU tensors with Hugging Face parameter names; with
    ``quantization`` "gguf" (``gguf_weights.choose_quantization``) a GGUF file's quantized matrices
    stay in their blocks (``QuantWeight``s, which ``build_model`` serves quantized)."""
    if quantization == "gguf":
        from .gguf_weights import gguf_path, read_gguf

        return read_gguf(gguf_path(source), hf_config).state
    if source.gguf_file:
        hide_hub_kernels()
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(
            source.directory, gguf_file=source.gguf_file, dtype=torch.float32, trust_remote_code=False
        )
        return dict(hf_model.state_dict())
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(source.directory, "*.safetensors")))
    if not files:
        pickled = sorted(os.path.basename(f) for pattern in ("*.bin", "*.pt", "*.pth")
                         for f in glob.glob(os.path.join(source.directory, pattern)))
        hint = (f" ({', '.join(pickled[:3])}: pickle files are never read, since loading one runs code; "
                "save the model as safetensors first, e.g. transformers' save_pretrained)") if pickled else ""
        raise ValueError(f"{source.directory} has no *.safetensors files{hint}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path))
    return state


def load_weights(source: ModelSource, hf_config, quantization: str, device_type: str = "cpu"):
    """``load_state_dict`` of ``source`` as ``--quantization quantization`` chooses on a
    ``device_type`` device, and the choice (``gguf_weights.QuantizationChoice``, for the log)."""
    from .gguf_weights import choose_quantization, gguf_path

    choice = choose_quantization(quantization, gguf_path(source) is not None, hf_config.model_type, device_type)
    return load_state_dict(source, choice.mode, hf_config), choice


def check_shapes(state: dict[str, torch.Tensor], model: CausalLM) -> None:
    """Refuse, in one line naming it, a checkpoint tensor whose shape is not the parameter's (as
    this rank holds it: a fused projection is named with its parts)."""
    params = model.state_dict()
    for name, tensor in state.items():
        want = params.get(name)
        if want is not None and tuple(want.shape) != tuple(tensor.shape):
            parts = next((f" (joined from {', '.join(p)})" for fused, p in FUSED_PROJECTIONS.items()
                          if f".{fused}." in name), "")
            raise ValueError(f"weight {name}{parts} has shape {tuple(tensor.shape)} but the model's config "
                             f"needs {tuple(want.shape)}")


def build_model(
    hf_config, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
    max_model_len: int, plan: ShardPlan | None = None, comm=None, int8: bool = False,
) -> CausalLM:
    """Instantiate our model for a transformers config (its family's, ``architectures.py``)
    and load ``state_dict`` into it.

    With a ``plan`` (and its rank's communicator), the model is that rank's shard and loads only
    its slices of the full ``state_dict``. ``int8``: the matmul weights quantized to int8 before
    the split and served so (``int8_weights.py``).
    """
    fam = family(hf_config)
    cls, cfg = fam.model_class, fam.config(hf_config)
    plan = plan or ShardPlan.for_model(cfg)
    with torch.device("meta"):
        model = cls(cfg, max_model_len, plan, comm)
    # Module.to_empty's empty_like on meta tensors runs torch's Python reference ops, whose first
    # use imports torch._decomp and sympy (about 0.4 s of each start): torch.empty by shape instead.
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    state, scales = fam.hf_state_dict(state_dict, cfg), {}
    if int8:
        state, scales = quantize_state_int8(state)
    state, quantized = take_quantized(state)  # GGUF blocks: quantized.py
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        quantized.pop("lm_head.weight", None)
    state = fuse_projections(shard_state_dict(state, plan))  # each rank's q, k, v cut, then joined
    check_shapes(state, model)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=False)
    quantized_modules = fused_names(quantized)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")
               and m.removesuffix(".weight") not in quantized_modules]
    if missing or unexpected:
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.input_embeddings.weight
    model = model.to(dtype=dtype).eval()
    if quantized:
        install_quantized(model, quantized, plan, dtype)
    if scales:
        install_int8(model, split_int8(scales, plan), dtype)
    model.build_buffers(max_model_len, device)  # e.g. the rotary table, float32 whatever the weights are
    return model
