"""Python calls in a list (Llama 3.2's and 4's, ToolACE): ``[get_weather(city="Paris"), f(x=1)]``,
as the whole output (Llama 4 may wrap it in ``<|python_start|>``/``<|python_end|>``, which the
detokenizer drops). Read with Python's ``ast``: keyword arguments whose values are literals only
(strings, numbers, True/False/None, lists, dicts); anything else is not a call. A call's arguments
are known only once its closing parenthesis comes: a stream sends each call whole, then."""

from __future__ import annotations

import ast
import json

from services.frontend.tool_parsers.incremental import MAX_DEPTH, Malformed, Reader, Reading, end_call, expect, peek, skip

MARKERS = ()
AT_START = ("[",)
SPECIAL_MARKERS = ()
BLANKS = " \t\n\r\f"
_OPENS, _CLOSES = "([{", ")]}"


def read(r: Reader) -> Reading:
    yield from skip(r)
    yield from expect(r, "[")
    char = yield from skip(r, BLANKS)
    while True:
        start = r.pos
        while (char := (yield from peek(r))) is not None and (r.text[start:r.pos] + char).isidentifier():
            r.pos += 1
        name = r.text[start:r.pos]
        if not name or (yield from skip(r, BLANKS)) != "(":
            raise Malformed(f"expected a call at {start}")
        yield from _group(r)
        end_call(r, name, _arguments(r.text[start:r.pos]), False)
        char = yield from skip(r, BLANKS)
        if char not in (",", "]"):
            raise Malformed(f"expected ',' or ']' at {r.pos}")
        r.pos += 1
        if char == "," and (yield from skip(r, BLANKS)) == "]":
            r.pos += 1
        if r.text[r.pos - 1] == "]":
            break
    if (yield from skip(r)) is not None:
        raise Malformed(f"text after the calls at {r.pos}")


def _group(r: Reader) -> Reading:
    """Past brackets that open here and what they hold, to where they close (strings skipped)."""
    depth = 0
    while True:
        char = yield from peek(r)
        if char is None:
            raise Malformed("a call cut short")
        r.pos += 1
        if char in "'\"":
            yield from _string(r, char)
        elif char in _OPENS:
            depth += 1
            if depth > MAX_DEPTH:
                raise Malformed("nested too deep")
        elif char in _CLOSES:
            depth -= 1
            if depth == 0:
                return


def _string(r: Reader, quote: str) -> Reading:
    """Past a Python string whose first quote was read (``''`` and triple quotes too)."""
    triple = False
    if (yield from peek(r)) == quote:
        r.pos += 1
        if (yield from peek(r)) != quote:
            return  # ''
        r.pos, triple = r.pos + 1, True
    while True:
        char = yield from peek(r)
        if char is None or (char == "\n" and not triple):
            raise Malformed("a string cut short")
        r.pos += 1
        if char == "\\":
            if (yield from peek(r)) is None:
                raise Malformed("a string cut short")
            r.pos += 1
        elif char == quote and (not triple or r.text.endswith(quote * 3, 0, r.pos)):
            return


def _arguments(text: str) -> str:
    """One call's text (``name(key=literal, ...)``) -> its arguments as JSON text."""
    node = ast.parse(text, mode="eval").body
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise Malformed("not a call with keyword arguments")
    if any(kw.arg is None for kw in node.keywords):  # **kwargs
        raise Malformed("not a call with keyword arguments")
    arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)
