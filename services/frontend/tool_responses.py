"""Tool calls in responses (``tools`` reads the fields and sets the guide): one call in OpenAI's
shape, a "required" output's calls, and an "auto" output's, parsed by the request's tool-call
parser (``tool_parsers``)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from services.frontend.tool_parsers import parse


def new_call_id() -> str:
    """A call's id, as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    """One call in OpenAI's shape (with ``index`` in a streamed delta), with a new id as vLLM makes them."""
    call = {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index} | call


def parse_required(text: str) -> list[tuple[str, str]] | None:
    """A "required" output's calls, ``(name, arguments as JSON text)``; None when ``text`` is not a
    complete array of calls (cut short by ``length`` or a ``stop`` string)."""
    try:
        value = json.loads(text)
        spans = _parameter_spans(text)
    except (ValueError, RecursionError):  # (a guide allows any depth where a schema allows any value)
        return None
    if not isinstance(value, list) or not value or len(spans) != len(value):
        return None
    calls = []
    for item, (start, end) in zip(value, spans):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "parameters" not in item:
            return None
        calls.append((item["name"], text[start:end]))  # as generated: no number or key rewritten
    return calls


def _parameter_spans(text: str) -> list[tuple[int, int]]:
    """Where each call's ``parameters`` value lies in an array of ``{"name": ..., "parameters":
    ...}`` objects, keys in that order (as the guide writes them); ``ValueError`` otherwise."""
    decoder, spans, pos = json.JSONDecoder(), [], 0

    def skip(at: int) -> int:
        while at < len(text) and text[at] in " \t\n\r":
            at += 1
        return at

    def expect(at: int, char: str) -> int:
        at = skip(at)
        if text[at:at + 1] != char:
            raise ValueError(f"expected {char!r} at {at}")
        return at + 1

    pos = expect(pos, "[")
    while True:
        pos = expect(pos, "{")
        for key in ("name", "parameters"):
            found, pos = decoder.raw_decode(text, skip(pos))
            if found != key:
                raise ValueError(f"expected the key {key!r} at {pos}")
            start = skip(expect(pos, ":"))
            _, pos = decoder.raw_decode(text, start)
            if key == "parameters":
                spans.append((start, pos))
            else:
                pos = expect(pos, ",")
        pos = expect(pos, "}")
        pos = skip(pos)
        if text[pos:pos + 1] == "]":
            return spans
        pos = expect(pos, ",")


def parse_auto(parser: str, text: str, first_only: bool) -> tuple[str | None, list[dict[str, Any]]]:
    """An "auto" output's content and calls in OpenAI's shape (``first_only``: the first call only,
    for ``parallel_tool_calls: false``); text that is not calls is all content, with no calls."""
    content, calls = parse(parser, text)
    return content, [tool_call(c.name, c.arguments) for c in (calls[:1] if first_only else calls)]
