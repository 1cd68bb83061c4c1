"""Tool calls read as the text comes: each format's ``read(reader)`` is a generator that reads the
calls from ``Reader.text`` (the output from where its calls start) and yields when it needs text
that has not come yet; fed the whole text at once (``eof``) it runs to the end in one go. So the
same code reads a whole response (``tool_parsers.parse``) and a stream
(``tool_parsers.streaming``), and the two agree.

A reader reports on ``Reader.events``: ``("open", name, at)``: a call whose arguments (a JSON
object starting at ``at``) come next, streamable as they grow; ``("args_end", at)``: where those
arguments end; ``("end", name, arguments, streamed, at)``: a call read whole (``arguments`` the
exact JSON text the call's arguments are). It raises ``Malformed`` (a ``ValueError``) where the text
stops being calls in its format. ``Reader.mark`` is where the last call (or its envelope) ended.

JSON is read strictly (RFC 8259: no NaN, no trailing commas, no control characters in strings),
at most ``MAX_DEPTH`` levels deep; the arguments keep the text the model wrote (no key or number
rewritten), so a stream's pieces join to exactly the whole response's arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Generator
from typing import Any

MAX_DEPTH = 64  # nesting in a call's arguments; deeper is not a call
JSON_BLANKS = " \t\n\r"
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = {"t": "true", "f": "false", "n": "null"}

Reading = Generator[None, None, Any]


class Malformed(ValueError):
    """The text is not (or stops being) calls in the format."""


class Reader:
    def __init__(self, text: str = "", eof: bool = False) -> None:
        self.text, self.eof = text, eof
        self.pos = 0  # characters read
        self.mark = 0  # where the last call, or its envelope, ended
        self.events: list[tuple[Any, ...]] = []


def peek(r: Reader) -> Reading:
    """The next character, not taken; None at the end of the text."""
    while r.pos >= len(r.text):
        if r.eof:
            return None
        yield
    return r.text[r.pos]


def lookahead(r: Reader, size: int) -> Reading:
    """The next ``size`` characters (fewer at the end), not taken."""
    while len(r.text) - r.pos < size and not r.eof:
        yield
    return r.text[r.pos:r.pos + size]


def expect(r: Reader, literal: str) -> Reading:
    for char in literal:
        if (yield from peek(r)) != char:
            raise Malformed(f"expected {literal!r} at {r.pos}")
        r.pos += 1


def skip(r: Reader, blanks: str | None = None) -> Reading:
    """Past whitespace (``blanks``' characters, or any ``str.isspace``); the next character."""
    while True:
        char = yield from peek(r)
        if char is None or not (char in blanks if blanks is not None else char.isspace()):
            return char
        r.pos += 1


def json_string(r: Reader) -> Reading:
    """A JSON string, decoded."""
    start = r.pos
    yield from expect(r, '"')
    while True:
        found = _STRING_STOP.search(r.text, r.pos)
        if found is None:
            r.pos = len(r.text)
            if r.eof:
                raise Malformed("a string cut short")
            yield
            continue
        r.pos = found.start()
        if found.group() == '"':
            r.pos += 1
            return json.loads(r.text[start:r.pos])
        if found.group() != "\\":
            raise Malformed(f"a control character in a string at {r.pos}")
        r.pos += 1
        escape = yield from peek(r)
        if escape is None or escape not in '"\\/bfnrtu':
            raise Malformed(f"a bad escape at {r.pos}")
        r.pos += 1
        for _ in range(4 if escape == "u" else 0):
            digit = yield from peek(r)
            if digit is None or digit not in "0123456789abcdefABCDEF":
                raise Malformed(f"a bad \\u escape at {r.pos}")
            r.pos += 1


def json_value(r: Reader, depth: int = 0) -> Reading:
    """Past one JSON value."""
    char = yield from peek(r)
    if char in ("{", "["):
        if depth >= MAX_DEPTH:
            raise Malformed("nested too deep")
        yield from _container(r, "}" if char == "{" else "]", depth)
    elif char == '"':
        yield from json_string(r)
    elif char is not None and char in "-0123456789":
        start = r.pos
        while (char := (yield from peek(r))) is not None and char in "+-.eE0123456789":
            r.pos += 1
        if not _NUMBER.fullmatch(r.text, start, r.pos):
            raise Malformed(f"a bad number at {start}")
    elif char in _LITERALS:
        yield from expect(r, _LITERALS[char])
    else:
        raise Malformed(f"expected a JSON value at {r.pos}")


def _container(r: Reader, close: str, depth: int) -> Reading:
    r.pos += 1
    char = yield from skip(r, JSON_BLANKS)
    if char == close:
        r.pos += 1
        return
    while True:
        if close == "}":
            if char != '"':
                raise Malformed(f"expected a key at {r.pos}")
            yield from json_string(r)
            yield from _colon(r)
        yield from json_value(r, depth + 1)
        char = yield from skip(r, JSON_BLANKS)
        if char not in (close, ","):
            raise Malformed(f"expected ',' or {close!r} at {r.pos}")
        r.pos += 1
        if char == close:
            return
        char = yield from skip(r, JSON_BLANKS)


def _colon(r: Reader) -> Reading:
    if (yield from skip(r, JSON_BLANKS)) != ":":
        raise Malformed(f"expected ':' at {r.pos}")
    r.pos += 1
    return (yield from skip(r, JSON_BLANKS))


def call_object(r: Reader, argument_keys: tuple[str, ...]) -> Reading:
    """``{"name": str, <one of argument_keys>: object}`` (``type`` and ``id`` allowed too, anything
    else not): once the name is known, arguments that follow are streamed (``open``)."""
    yield from expect(r, "{")
    name, arguments, streamed, seen = None, "{}", False, set()
    char = yield from skip(r, JSON_BLANKS)
    while True:
        if char != '"':
            raise Malformed(f"expected a key at {r.pos}")
        key = yield from json_string(r)
        if key in seen or key not in ("name", "type", "id", *argument_keys) or (
                key in argument_keys and seen & set(argument_keys)):
            raise Malformed(f"the key {key!r} in a call")
        seen.add(key)
        char = yield from _colon(r)
        start = r.pos
        if key == "name":
            if char != '"':
                raise Malformed(f"a name that is not a string at {r.pos}")
            name = yield from json_string(r)
        elif key in argument_keys and char == "{" and name is not None:
            r.events.append(("open", name, start))
            yield from json_value(r)
            r.events.append(("args_end", r.pos))
            arguments, streamed = r.text[start:r.pos], True
        elif key in argument_keys:
            yield from json_value(r)
            arguments = decoded_arguments(r.text[start:r.pos])
        else:
            yield from json_value(r)
        char = yield from skip(r, JSON_BLANKS)
        if char not in ("}", ","):
            raise Malformed(f"expected ',' or '}}' at {r.pos}")
        r.pos += 1
        if char == "}":
            break
        char = yield from skip(r, JSON_BLANKS)
    end_call(r, name, arguments, streamed)


def end_call(r: Reader, name: str | None, arguments: str, streamed: bool) -> None:
    """A call read whole: its name and arguments checked, reported (``end``), the mark moved."""
    if not name:
        raise Malformed("a call without a name")
    try:  # what goes out as UTF-8 (names decoded from escapes, arguments re-read by the Messages API)
        name.encode()
        json.dumps(_object(arguments), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise Malformed("a lone surrogate in a call") from None
    r.events.append(("end", name, arguments, streamed, r.pos))
    r.mark = r.pos


def decoded_arguments(text: str) -> str:
    """A call's arguments written whole: an object as written, or an object written as JSON text (some
    fine-tunes do) as that text."""
    value = json.loads(text, parse_constant=_no_constant)
    if isinstance(value, str):
        _object(value)
        return value
    if not isinstance(value, dict):
        raise Malformed("arguments that are not an object")
    return text


def _object(text: str) -> dict[str, Any]:
    value = json.loads(text, parse_constant=_no_constant)
    if not isinstance(value, dict):
        raise Malformed("arguments that are not an object")
    return value


def _no_constant(name: str) -> None:
    raise Malformed(f"{name} is not JSON")
