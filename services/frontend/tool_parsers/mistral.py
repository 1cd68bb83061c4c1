"""Mistral's calls (Mistral 7B v0.3, Mixtral, Mistral Nemo and Small): ``[TOOL_CALLS]`` and a JSON
array of ``{"name": "f", "arguments": {...}}`` objects, after any text."""

from __future__ import annotations

import json

from services.frontend.tool_parsers import ToolCall, call_of

TOOL_CALLS = "[TOOL_CALLS]"
MARKERS = (TOOL_CALLS,)
AT_START = ("[{",)  # the marker is a special token, which the detokenizer drops


def parse_calls(rest: str) -> list[ToolCall] | None:
    rest = rest.strip()
    if rest.startswith(TOOL_CALLS):
        rest = rest[len(TOOL_CALLS):]
    value = json.loads(rest)
    if not isinstance(value, list):
        return None
    calls = [call_of(item, "arguments", "parameters") for item in value]
    return None if None in calls else calls
