"""A tool-call parser fed the output in pieces, as a stream makes it: content deltas as the text
comes, holding back whatever might start a call (a marker's first characters, and the whitespace
before them, which content before calls drops); once the calls have started, nothing until the end,
where ``finish`` parses the whole text as ``parse`` does. So the content deltas joined and the calls
are ``parse``'s, and a call is sent only when the output is known to be calls (a later malformed
call makes all of it content). The deltas are in OpenAI's shape: ``{"content": ...}``, and per
call a header ``{"tool_calls": [{"index", "id", "type": "function", "function": {"name",
"arguments": ""}}]}`` then its arguments ``{"tool_calls": [{"index", "function": {"arguments"}}]}``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.frontend.partial_marks import partial_suffix
from services.frontend.tool_parsers import ToolCall, call_start, parse, parser_format


class StreamingToolParser:
    """One choice's output. ``new_id`` makes each call's id; ``first_only``: keep the first call."""

    def __init__(self, name: str, new_id: Callable[[], str], first_only: bool = False) -> None:
        self.name, self.new_id, self.first_only = name, new_id, first_only
        self._fmt = parser_format(name)
        self._pieces: list[str] = []  # the whole text
        self._sent = 0  # characters of the text sent as content
        self._tail = ""  # the text after them, until the calls start
        self._calls_started = False
        self.num_calls = 0  # calls sent, once finished

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self._pieces.append(piece)
        if self._calls_started:
            return []
        self._tail += piece
        start = call_start(self._fmt, self._tail, at_start=self._sent == 0)
        if start is not None:
            self._calls_started = True
            return self._content(len(self._tail[:start].rstrip()))
        return self._content(self._held_from())

    def finish(self) -> list[dict[str, Any]]:
        text = "".join(self._pieces)
        content, calls = parse(self.name, text)
        self._tail = text[self._sent:]
        if not calls:
            return self._content(len(self._tail))
        deltas = self._content(len(content or "") - self._sent)
        for index, call in enumerate(calls[:1] if self.first_only else calls):
            deltas += call_deltas(index, call, self.new_id())
        self.num_calls = 1 if self.first_only else len(calls)
        return deltas

    def _held_from(self) -> int:
        """Where, in the unsent tail, the text that might start a call begins (its end when none may)."""
        tail = self._tail
        if self._sent == 0 and (not tail.strip() or any(s.startswith(tail.lstrip()) for s in self._fmt.AT_START)):
            return 0  # (content sent: the output does not start with calls, nor with whitespace only)
        held = len(tail) - max((partial_suffix(tail, marker) for marker in self._fmt.MARKERS), default=0)
        while held > 0 and tail[held - 1].isspace():
            held -= 1
        return held

    def _content(self, upto: int) -> list[dict[str, Any]]:
        """The tail's first ``upto`` characters as content."""
        if upto <= 0:
            return []
        piece, self._tail, self._sent = self._tail[:upto], self._tail[upto:], self._sent + upto
        return [{"content": piece}]


def call_deltas(index: int, call: ToolCall, call_id: str) -> list[dict[str, Any]]:
    """A call as a stream sends it: its header (name, empty arguments), then its arguments."""
    header = {"index": index, "id": call_id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [{"tool_calls": [header]}, {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
