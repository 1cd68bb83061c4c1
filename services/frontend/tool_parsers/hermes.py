"""Hermes' format (Nous Hermes 2/3, Qwen2.5, Qwen3 and many fine-tunes): each call a JSON object in
its own tags, ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, after any text."""

from __future__ import annotations

import json

from services.frontend.tool_parsers import ToolCall, call_of

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MARKERS = (OPEN,)
AT_START = ()


def parse_calls(rest: str) -> list[ToolCall] | None:
    calls, rest = [], rest.strip()
    while rest:
        if not rest.startswith(OPEN) or CLOSE not in rest:
            return None
        body, _, rest = rest[len(OPEN):].partition(CLOSE)
        call = call_of(json.loads(body), "arguments", "parameters")
        if call is None:
            return None
        calls.append(call)
        rest = rest.strip()
    return calls
