"""A model's config checked before anything is built from it, with one-line errors.

``load_hf_config`` reads a model's config the way every process does, never running the model's
own code: for a directory it first reads ``config.json`` itself and checks the sizes
(``model_shape``), because ``transformers`` divides by the head count while parsing; a supported
model's config is then used as it is (``PlainConfig``), anything else goes through ``transformers``,
and whatever goes wrong there becomes one line. ``check_memory`` compares what a
process is about to allocate with the memory the machine has available.

Every error is a ``ModelCheckError`` (a ``ValueError``, which the command line prints as one line
and exits with code 2).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from shared.hub_kernels import hide_hub_kernels
from shared.model_source import ModelSource, kernels_clash_hint

GIB = 2**30


class ModelCheckError(ValueError):
    """A model that cannot be served as configured; the message is one line."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide what a decoder-only transformer allocates."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    # what differs between the families the executor builds (``weight_bytes``): matrices per MLP (3 for
    # the gated Llama MLP, 2 for OPT's fc1/fc2), the width of the token embeddings and LM head (OPT's
    # ``word_embed_proj_dim``; the hidden size elsewhere), rows of learned position embeddings (OPT's)
    mlp_matrices: int
    embedding_dim: int
    position_rows: int


# multimodal model types served as their text model (the image tower's weights are not loaded)
TEXT_MODELS = {"gemma3": "gemma3_text"}


def text_model_json(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal ``config.json`` (``TEXT_MODELS``) as its text model's config, else ``config``."""
    text = config.get("text_config")
    if config.get("model_type") not in TEXT_MODELS or not isinstance(text, dict):
        return config
    return {**text, "model_type": TEXT_MODELS[config["model_type"]]}


def read_config_json(directory: str) -> dict[str, Any]:
    """``directory``/config.json as a JSON object (a multimodal model's: its text model's,
    ``text_model_json``), or a one-line ``ModelCheckError``."""
    path = os.path.join(directory, "config.json")
    try:
        with open(path, "rb") as f:
            config = json.loads(f.read())
    except OSError as exc:
        raise ModelCheckError(f"--model {directory}: cannot read config.json: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise ModelCheckError(f"--model {directory}: config.json is not valid JSON: {_one_line(exc)}") from None
    if not isinstance(config, dict):
        raise ModelCheckError(f"--model {directory}: config.json must hold a JSON object, not {type(config).__name__}")
    return text_model_json(config)


def model_shape(config: Mapping[str, Any], where: str) -> ModelShape:
    """Check a Hugging Face config's sizes (a ``config.json`` object or ``PretrainedConfig.to_dict()``)
    and return them. ``where`` names the model in messages."""

    def size(name: str, value: Any = None) -> int:
        value = config.get(name) if value is None else value
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelCheckError(f"{where}: {name} must be a positive integer, got {value!r}")
        return value

    opt = config.get("model_type") == "opt"
    hidden_size = size("hidden_size")
    num_heads = size("num_attention_heads")
    num_kv_heads = num_heads if config.get("num_key_value_heads") is None else size("num_key_value_heads")
    if config.get("head_dim") is not None:
        head_dim = size("head_dim")
    elif hidden_size % num_heads:
        raise ModelCheckError(f"{where}: hidden_size {hidden_size} is not divisible by num_attention_heads "
                              f"{num_heads} (and no head_dim is given)")
    else:
        head_dim = hidden_size // num_heads
    if num_heads % num_kv_heads:
        raise ModelCheckError(f"{where}: num_attention_heads {num_heads} is not divisible by "
                              f"num_key_value_heads {num_kv_heads}")
    for name in ("rms_norm_eps", "rope_theta"):
        value = config.get(name)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and math.isfinite(value) and value > 0):
            raise ModelCheckError(f"{where}: {name} must be a positive number, got {value!r}")
    max_positions = size("max_position_embeddings")
    return ModelShape(
        vocab_size=size("vocab_size"), hidden_size=hidden_size,
        intermediate_size=size("ffn_dim" if opt else "intermediate_size"),
        num_layers=size("num_hidden_layers"), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions,
        # OPT's checkpoints tie the LM head to the embeddings (OPTConfig's default)
        tie_word_embeddings=bool(config.get("tie_word_embeddings", opt)),
        mlp_matrices=2 if opt else 3,
        embedding_dim=size("word_embed_proj_dim") if opt and config.get("word_embed_proj_dim") is not None else hidden_size,
        position_rows=max_positions + 2 if opt else 0,  # OPT's table is offset by 2
    )


# The model types the executor builds, and the one default transformers' config classes disagree on
# (``num_key_value_heads``: Llama's is the head count, Mistral's 8, Qwen2's 32). Their other defaults
# that matter here agree: ``rms_norm_eps`` 1e-6, rotary base 10000, untied embeddings, ``head_dim``
# = hidden size / heads, no attention bias.
PLAIN_MODEL_TYPES = ("llama", "mistral", "qwen2")


class PlainConfig:
    """A ``config.json`` read as it is, with the attribute and ``to_dict()`` access of a
    ``transformers`` config: what the engine reads of a supported model's config without importing
    ``transformers`` (about 1.3 s of each executor's start here, with torch already imported).
    Only for configs ``plain_config`` accepts; a missing key reads as the classes' shared default."""

    DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False}

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = {**self.DEFAULTS, **config}

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_config"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, Any]:
        return dict(self._config)


def plain_config(config: Mapping[str, Any]) -> PlainConfig | None:
    """``config`` (a checked ``config.json``) as a ``PlainConfig`` when nothing in it needs
    ``transformers`` to be read right, else None: a supported model type with its KV head count
    (and Mistral's window) given, no remote code, and rotary settings in either of transformers' two forms."""
    if config.get("model_type") not in PLAIN_MODEL_TYPES or "auto_map" in config:
        return None
    if not isinstance(config.get("num_key_value_heads"), int):
        return None
    if config["model_type"] == "mistral" and "sliding_window" not in config:
        return None  # MistralConfig's default window (4096) applies
    if config.get("use_sliding_window") and "layer_types" not in config:
        return None  # Qwen2's windowed layers follow from max_window_layers: transformers says which
    rope = config.get("rope_parameters")
    if rope is not None and not (isinstance(rope, dict) and "rope_theta" in rope):
        return None
    if rope is not None and rope.get("rope_type", rope.get("type", "default")) not in ("default", "linear"):
        return None  # a scaled table (llama3, yarn...) is computed by transformers' own functions
    if config.get("rope_scaling") is not None and rope is None:
        return None  # transformers folds rope_scaling into rope_parameters: let it
    return PlainConfig(config)


def load_hf_config(source: ModelSource) -> Any:
    """The model's config, checked (``model_shape``), with remote code refused: a ``PlainConfig``
    where ``plain_config`` accepts ``config.json``, else ``transformers``' ``AutoConfig``."""
    where = f"--model {source.where}"
    if source.gguf_file is None:
        config = read_config_json(source.directory)
        model_shape(config, where)  # before transformers divides by zero
        plain = plain_config(config)
        if plain is not None:
            return plain
    hide_hub_kernels()
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source.directory, trust_remote_code=False, **source.pretrained_kwargs())
    except Exception as exc:  # transformers raises anything (OSError, ValueError, KeyError, ZeroDivisionError...)
        message = f"{type(exc).__name__}: {_one_line(exc)}{kernels_clash_hint(exc)}"
        raise ModelCheckError(f"{where}: cannot read the model config: {message}") from None
    if getattr(config, "model_type", None) in TEXT_MODELS:
        config = config.text_config  # served as a text model
    model_shape(config.to_dict(), where)
    return config


def weight_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes of a model's weight matrices: embeddings, attention, MLP, norms, LM head (biases, a few
    thousand elements per layer, and OPT's projections between embedding and hidden widths left out)."""
    s = shape
    attention = s.hidden_size * s.head_dim * (2 * s.num_heads + 2 * s.num_kv_heads)  # q, o; k, v
    mlp = s.mlp_matrices * s.hidden_size * s.intermediate_size  # gate, up, down (OPT: fc1, fc2)
    per_layer = attention + mlp + 2 * s.hidden_size  # two norms
    embeddings = s.vocab_size * s.embedding_dim * (1 if s.tie_word_embeddings else 2)
    positions = s.position_rows * s.hidden_size
    return dtype_bytes * (embeddings + positions + s.num_layers * per_layer + s.hidden_size)


def kv_block_bytes(shape: ModelShape, block_size: int, dtype_bytes: int, scale_bytes: int = 0) -> int:
    """Bytes one KV block takes across all layers (keys and values): ``dtype_bytes`` per element,
    plus ``scale_bytes`` per (token, KV head) row (a quantized cache's scales, ``--kv-cache-dtype``)."""
    return 2 * shape.num_layers * shape.num_kv_heads * block_size * (shape.head_dim * dtype_bytes + scale_bytes)


def available_memory_bytes() -> int | None:
    """Memory the machine can still give (``MemAvailable``, else free physical pages), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_memory(parts: Mapping[str, int], where: str, available_bytes: int | None = None,
                 holder: str = "this machine has") -> None:
    """Refuse when the sum of ``parts`` (name -> bytes) exceeds the available memory (the host's,
    or ``available_bytes`` that ``holder`` has: a GPU's free memory)."""
    available = available_memory_bytes() if available_bytes is None else available_bytes
    needed = sum(parts.values())
    if available is None or needed <= available:
        return
    detail = " + ".join(f"{name} {value / GIB:,.1f} GiB" for name, value in parts.items())
    raise ModelCheckError(
        f"{where} needs {needed / GIB:,.1f} GiB ({detail}) but {holder} {available / GIB:,.1f} GiB "
        f"available; lower --kv-cache-memory / --num-kv-blocks, --swap-space or --max-model-len, or use a "
        f"smaller model"
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."
