"""Llama 3.1 to 3.3's JSON calls: ``{"name": "f", "parameters": {...}}`` (``arguments`` taken too),
several separated by ``;``, after ``<|python_tag|>`` or as the whole output."""

from __future__ import annotations

from services.frontend.tool_parsers.incremental import Malformed, Reader, Reading, call_object, lookahead, skip

PYTHON_TAG = "<|python_tag|>"
MARKERS = (PYTHON_TAG,)
AT_START = ("{",)
SPECIAL_MARKERS = (PYTHON_TAG,)


def read(r: Reader) -> Reading:
    if (yield from skip(r)) == "<" and (yield from lookahead(r, len(PYTHON_TAG))) == PYTHON_TAG:
        r.pos += len(PYTHON_TAG)
    while True:
        yield from skip(r)
        yield from call_object(r, ("parameters", "arguments"))
        char = yield from skip(r)
        if char is None:
            return
        if char != ";":
            raise Malformed(f"expected ';' at {r.pos}")
        r.pos += 1
