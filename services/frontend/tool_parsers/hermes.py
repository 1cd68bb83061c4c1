"""Hermes' format (Nous Hermes 2/3, Qwen2.5, Qwen3 and many fine-tunes): each call a JSON object in
its own tags, ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, after any text."""

from __future__ import annotations

from services.frontend.tool_parsers.incremental import JSON_BLANKS, Reader, Reading, call_object, expect, skip

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MARKERS = (OPEN,)
AT_START = ()
SPECIAL_MARKERS = ()  # Qwen's tags are added tokens that decode with the text


def read(r: Reader) -> Reading:
    while (yield from skip(r)) is not None:
        yield from expect(r, OPEN)
        yield from skip(r, JSON_BLANKS)
        yield from call_object(r, ("arguments", "parameters"))
        yield from skip(r, JSON_BLANKS)
        yield from expect(r, CLOSE)
        r.mark = r.pos
