"""A tool-call parser fed the output in pieces, as a stream makes it, sending deltas in OpenAI's
shape: ``{"content": ...}``; per call a header ``{"tool_calls": [{"index", "id", "type":
"function", "function": {"name", "arguments": ""}}]}`` once its name is known, then its arguments in
pieces ``{"tool_calls": [{"index", "function": {"arguments"}}]}`` as the model writes them (a
pythonic call's once its parenthesis closes). The pieces of a call join to exactly the arguments
``parse`` gives.

Before the calls, content goes out as it comes, holding back whatever might start a call (a
marker's first characters, and the whitespace before them, which content before calls drops).
Once they start, the format's reader (``incremental``) reads them as they come.

A malformed output: a stream cannot take back what it sent, so

- while no call has been sent (the output broke before a call's name and arguments began), the
  held text and everything after is content: the stream joins to ``parse``'s all-content answer;
- once one has, what was sent stays: a call whose arguments break is left as sent (its arguments
  incomplete JSON) and the rest of the output, from where they broke, is content; text after whole
  calls that is not a call is content (leading whitespace dropped). ``made_calls`` is then true only
  if every call sent was whole: the stream's ``finish_reason`` says ``tool_calls`` only for calls a
  client can run (a call cut by ``max_tokens`` finishes ``length``, as OpenAI's do).

Every character of the output is sent at most once; for a well-formed output the content and calls
equal ``parse``'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.frontend.partial_marks import partial_suffix
from services.frontend.tool_parsers import READ_ERRORS, call_start, parser_format
from services.frontend.tool_parsers.incremental import Reader


class StreamingToolParser:
    """One choice's output. ``new_id`` makes each call's id; ``first_only``: send the first call only."""

    def __init__(self, name: str, new_id: Callable[[], str], first_only: bool = False) -> None:
        self.name, self.new_id, self.first_only = name, new_id, first_only
        self._fmt = parser_format(name)
        self._sent = 0  # characters sent as content before the calls
        self._tail = ""  # the text after them: until the calls start, then the whitespace before them
        self._reader: Reader | None = None  # once the calls start: the text from there
        self._reading: Any = None  # the format's reader, a generator
        self._plain = False  # malformed: the rest is content as it comes
        self._open: tuple[int, int] | None = None  # the call whose arguments stream: (index, sent up to)
        self._unfinished = False  # the call opened (its header sent) has not ended
        self._args_ended = False  # the open call's arguments have all come
        self._num_read = 0  # calls the reader has started
        self.num_calls = 0  # calls sent
        self._broken = False  # a sent call's arguments broke

    @property
    def made_calls(self) -> bool:
        """Calls were sent, every one whole."""
        return self.num_calls > 0 and not self._broken

    def feed(self, piece: str) -> list[dict[str, Any]]:
        if self._plain:
            return [{"content": piece}] if piece else []
        if self._reader is not None:
            self._reader.text += piece
            return self._read()
        self._tail += piece
        start = call_start(self._fmt, self._tail, at_start=self._sent == 0)
        if start is None:
            return self._content(self._held_from())
        calls, self._tail = self._tail[start:], self._tail[:start]
        deltas = self._content(len(self._tail.rstrip()))
        self._reader = Reader(calls)
        self._reading = self._fmt.read(self._reader)
        return deltas + self._read()

    def finish(self) -> list[dict[str, Any]]:
        if self._plain:
            return []
        if self._reader is None:
            return self._content(len(self._tail))
        self._reader.eof = True
        return self._read()

    def _read(self) -> list[dict[str, Any]]:
        """Run the reader over what has come; the deltas it makes."""
        error = None
        try:
            self._reading.send(None)
        except StopIteration:
            pass
        except READ_ERRORS as exc:
            error = exc
        deltas = self._deltas()
        return deltas + self._malformed() if error is not None else deltas

    def _deltas(self) -> list[dict[str, Any]]:
        reader, deltas = self._reader, []
        for event in reader.events:
            if event[0] == "open":
                deltas += self._header(event[1])
                self._open = (self._num_read - 1, event[2])
                self._unfinished = self._sends(self._num_read - 1)
            elif event[0] == "args_end":
                deltas += self._arguments(event[1])
                self._args_ended = True
            elif event[3]:  # ("end", name, arguments, streamed, at): the open call ended
                self._open, self._unfinished, self._args_ended = None, False, False
            else:  # a call read whole
                deltas += self._header(event[1])
                if self._sends(self._num_read - 1):
                    deltas.append(arguments_delta(self._num_read - 1, event[2]))
        reader.events.clear()
        return deltas + (self._arguments(reader.pos) if self._open is not None and not self._args_ended else [])

    def _sends(self, index: int) -> bool:
        return index == 0 or not self.first_only

    def _header(self, name: str) -> list[dict[str, Any]]:
        index = self._num_read
        self._num_read += 1
        if not self._sends(index):
            return []
        self.num_calls += 1
        return [header_delta(index, name, self.new_id())]

    def _arguments(self, upto: int) -> list[dict[str, Any]]:
        """The open call's arguments up to ``upto``, those not sent yet."""
        index, sent = self._open
        self._open = (index, max(sent, upto))
        if upto <= sent or not self._sends(index):
            return []
        return [arguments_delta(index, self._reader.text[sent:upto])]

    def _malformed(self) -> list[dict[str, Any]]:
        """The output stopped being calls: what is not sent goes as content (see the docstring)."""
        reader, self._plain = self._reader, True
        if self.num_calls == 0:
            rest = self._tail + reader.text
        elif self._unfinished:
            rest, self._broken = reader.text[self._open[1]:], True
        else:
            rest = reader.text[reader.mark:].lstrip()
        self._open = None
        return [{"content": rest}] if rest else []

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


def header_delta(index: int, name: str, call_id: str) -> dict[str, Any]:
    """A call's first delta: its id and name, empty arguments."""
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function",
                            "function": {"name": name, "arguments": ""}}]}


def arguments_delta(index: int, arguments: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}

