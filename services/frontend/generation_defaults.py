"""The model creator's sampling defaults (``--generation-config``), applied as vLLM 0.32 applies them:
a request that leaves out ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
``presence_penalty`` or ``frequency_penalty`` gets the value the model's ``generation_config.json``
recommends, and a chat request without ``max_tokens`` gets its ``max_new_tokens`` (where it would
have had the whole context left; completions keep the API's 16). Only values that differ from
transformers' own defaults count (its ``to_diff_dict``: a file's ``top_k: 50`` is transformers'
default, not a recommendation). A field the request gives always wins, and beam search requests
take no sampling default (beam search decides its own temperature and refuses the sampling fields).

``--generation-config``: ``auto`` (the default, as vLLM's): the model directory's file; ``vllm``:
none, the OpenAI defaults; or a directory holding a ``generation_config.json``, whose
``max_new_tokens`` is then also a limit on every request's ``max_tokens`` (vLLM's "server-wide
limit"). A value in the file outside the range the API accepts for its field is left out, with a
warning in the log.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import structlog

from shared.messages.sampling_rules import RANGES

log = structlog.get_logger()

FILE_NAME = "generation_config.json"
SETTINGS = ("auto", "vllm")  # or a directory

def _in_range(name: str) -> Callable[[Any], bool]:
    return lambda value: RANGES[name].reason(value) is None


# generation_config.json key -> (request field, transformers' default, the values the API accepts:
# the rulebook's range, ``shared.messages.sampling_rules.RANGES``, where it has one)
_KEYS: dict[str, tuple[str, Any, Callable[[Any], bool]]] = {
    "temperature": ("temperature", 1.0, _in_range("temperature")),
    "top_p": ("top_p", 1.0, _in_range("top_p")),
    "top_k": ("top_k", 50, lambda v: _integer(v) and v >= 1),
    "min_p": ("min_p", None, _in_range("min_p")),
    "repetition_penalty": ("repetition_penalty", 1.0, _in_range("repetition_penalty")),
    "presence_penalty": ("presence_penalty", None, _in_range("presence_penalty")),
    "frequency_penalty": ("frequency_penalty", None, _in_range("frequency_penalty")),
    "max_new_tokens": ("max_tokens", None, lambda v: _integer(v) and v >= 1),
}


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_setting(setting: str) -> None:
    """``ValueError`` (one line) unless ``setting`` is auto, vllm or a directory with the file."""
    if setting in SETTINGS:
        return
    if not os.path.isfile(os.path.join(os.path.expanduser(setting), FILE_NAME)):
        raise ValueError(f"--generation-config {setting}: not auto, vllm, or a directory holding {FILE_NAME}")


def read_generation_defaults(setting: str, model_directory: str) -> dict[str, Any]:
    """Request field -> default, from ``setting``'s file (see the module's docstring); {} for
    ``vllm`` and for ``auto`` where the model has no such file or one that cannot be read."""
    if setting == "vllm":
        return {}
    check_setting(setting)
    explicit = setting != "auto"
    path = os.path.join(os.path.expanduser(setting) if explicit else model_directory, FILE_NAME)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, not an object")
    except (OSError, ValueError) as exc:
        if explicit:
            raise ValueError(f"--generation-config: cannot read {path}: {exc}") from None
        log.warning("generation config not read", path=path, error=str(exc))
        return {}
    defaults: dict[str, Any] = {}
    for key, (name, hf_default, accepts) in _KEYS.items():
        value = config.get(key)
        if value is None or value == hf_default or (key == "top_k" and value == 0):  # (top_k 0: off)
            continue
        if accepts(value):
            defaults[name] = value
        else:
            log.warning("generation config value left out", path=path, key=key, value=value)
    return defaults


def max_tokens_limit(setting: str, defaults: dict[str, Any]) -> int | None:
    """The limit on every request's ``max_tokens``: a directory's ``max_new_tokens`` (None for auto
    and vllm, where the model's value is only chat's default)."""
    return None if setting in SETTINGS else defaults.get("max_tokens")


def with_generation_defaults(options, defaults: dict[str, Any]):
    """``options`` (``GenerationOptions``) with ``defaults``' sampling fields where the request gave
    none: a copy, or ``options`` itself when nothing applies (beam search, no defaults)."""
    fields = {name: value for name, value in defaults.items() if name != "max_tokens" and name not in options.given}
    if not fields or options.use_beam_search:
        return options
    return dataclasses.replace(options, **fields)
