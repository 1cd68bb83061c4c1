"""Mistral's calls, in either of its tokenizers' formats, after any text:

- v3 (Mistral 7B v0.3, Mixtral, Nemo): ``[TOOL_CALLS]`` and a JSON array of ``{"name": "f",
  "arguments": {...}}`` objects;
- v11 and later (Mistral Small 3.1+, Magistral, Devstral): ``[TOOL_CALLS]f[ARGS]{...}`` per call,
  one after another (``[CALL_ID]<id>`` may stand before ``[ARGS]``; its id is not kept).

``[TOOL_CALLS]``, ``[ARGS]`` and ``[CALL_ID]`` are special tokens: the detokenizer keeps them for
requests this parser reads (``SPECIAL_MARKERS``), as vLLM's parser turns ``skip_special_tokens``
off. A v3 array also counts without the marker, at the start of the output."""

from __future__ import annotations

import re

from services.frontend.tool_parsers.incremental import (
    JSON_BLANKS, Malformed, Reader, Reading, call_object, end_call, expect, json_value, lookahead, peek, skip,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MARKERS = (TOOL_CALLS,)
AT_START = ("[{",)
SPECIAL_MARKERS = (TOOL_CALLS, ARGS, CALL_ID)
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.-]")


def read(r: Reader) -> Reading:
    yield from skip(r)
    if (yield from lookahead(r, len(TOOL_CALLS))) != TOOL_CALLS:
        yield from _array(r)
        return
    r.pos += len(TOOL_CALLS)
    if (yield from skip(r)) == "[":
        yield from _array(r)
        return
    while True:  # v11: name[ARGS]{...}, each after its own [TOOL_CALLS]
        yield from _named_call(r)
        if (yield from skip(r)) is None:
            return
        yield from expect(r, TOOL_CALLS)


def _array(r: Reader) -> Reading:
    yield from expect(r, "[")
    char = yield from skip(r, JSON_BLANKS)
    while char != "]":
        yield from call_object(r, ("arguments", "parameters"))
        char = yield from skip(r, JSON_BLANKS)
        if char not in (",", "]"):
            raise Malformed(f"expected ',' or ']' at {r.pos}")
        if char == ",":
            r.pos += 1
            if (yield from skip(r, JSON_BLANKS)) != "{":
                raise Malformed(f"expected a call at {r.pos}")
    r.pos += 1
    r.mark = r.pos
    if (yield from skip(r)) is not None:
        raise Malformed(f"text after the calls at {r.pos}")


def _named_call(r: Reader) -> Reading:
    start = r.pos
    while (char := (yield from peek(r))) is not None and _NAME_CHARS.fullmatch(char):
        r.pos += 1
    name = r.text[start:r.pos]
    if char == "[" and (yield from lookahead(r, len(CALL_ID))) == CALL_ID:
        r.pos += len(CALL_ID)
        while (char := (yield from peek(r))) is not None and char.isalnum():
            r.pos += 1
    if char == "[":
        yield from expect(r, ARGS)
    if not name or (yield from peek(r)) != "{":
        raise Malformed(f"expected a name and its arguments at {start}")
    at = r.pos
    r.events.append(("open", name, at))
    yield from json_value(r)
    r.events.append(("args_end", r.pos))
    end_call(r, name, r.text[at:r.pos], True)
