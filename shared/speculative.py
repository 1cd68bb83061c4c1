"""``--speculative-config``: speculative decoding's settings, spelled as vLLM's JSON.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

Only ``ngram`` (prompt lookup) is built. ``parse`` validates the text and raises ``ValueError``
with one line saying what is wrong; the flag's argparse type calls it, so a bad value stops the
command at start.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from shared.flag_spec import json_object

METHODS = ("ngram",)
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: tokens proposed per step, at most
    prompt_lookup_min: int = 1  # the shortest suffix (n-gram) that is looked up
    prompt_lookup_max: int = 4  # the longest, tried first

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported (only {', '.join(METHODS)})")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative config: {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative config: prompt_lookup_min ({self.prompt_lookup_min}) is above "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.num_speculative_tokens > 32:
            raise ValueError(f"speculative config: num_speculative_tokens is at most 32, got "
                             f"{self.num_speculative_tokens}")


def parse(text: str | None) -> SpeculativeConfig | None:
    """The config that ``text`` (JSON, or None/"" for none) spells; ``ValueError`` if it is not one."""
    if not text:
        return None
    fields = json_object(text, "--speculative-config")
    unknown = set(fields) - _KEYS
    if unknown:
        raise ValueError(f"speculative config: unknown keys {sorted(unknown)} (known: {sorted(_KEYS)})")
    if "method" not in fields:
        raise ValueError('speculative config: "method" is required (only "ngram" is supported)')
    fields.setdefault("prompt_lookup_max", max(4, fields.get("prompt_lookup_min", 1)))
    fields.setdefault("prompt_lookup_min", 1)
    return SpeculativeConfig(**fields)


def flag_type(text: str) -> str:
    """argparse's type for the flag: the text itself, once ``parse`` accepts it."""
    try:
        parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
