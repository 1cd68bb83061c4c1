"""Llama 3.1 to 3.3's JSON calls: ``{"name": "f", "parameters": {...}}`` (``arguments`` taken too),
several separated by ``;``, after ``<|python_tag|>`` or as the whole output."""

from __future__ import annotations

import json

from services.frontend.tool_parsers import ToolCall, call_of

PYTHON_TAG = "<|python_tag|>"
MARKERS = (PYTHON_TAG,)
AT_START = ("{",)


def parse_calls(rest: str) -> list[ToolCall] | None:
    rest = rest.strip()
    if rest.startswith(PYTHON_TAG):
        rest = rest[len(PYTHON_TAG):]
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        at = _skip(rest, at)
        value, at = decoder.raw_decode(rest, at)
        call = call_of(value, "parameters", "arguments")
        if call is None:
            return None
        calls.append(call)
        at = _skip(rest, at)
        if at == len(rest):
            return calls
        if rest[at] != ";":
            return None
        at += 1


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
