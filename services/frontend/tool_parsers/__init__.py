"""Tool-call parsers for ``tool_choice: "auto"``: the calls a model writes in its own family's
format, told from its text (pure functions, no I/O). A format (one module each) gives

- ``MARKERS``: strings that start the calls wherever they stand (text before them is content);
- ``AT_START``: strings that start the calls only at the start of the output (after whitespace);
- ``SPECIAL_MARKERS``: its marks that tokenizers write as special tokens (the detokenizer keeps
  them for requests read with this parser: ``kept_special_ids``);
- ``read(reader)``: the calls in the text from where they start, read as it comes
  (``incremental``), raising ``Malformed`` where it is not calls from start to end.

``parse(name, text)`` gives ``(content, calls)``: ``content`` the text before the calls (trailing
whitespace dropped; None when nothing is left) and one ``ToolCall`` per call, its arguments the JSON
text the model wrote; text that is not calls in the format, or whose calls are malformed anywhere
(JSON that does not parse, a call cut short, text after the calls), is all content with no calls:
it never raises. A call to a name that is not among the request's tools is kept, as vLLM keeps it
(the parser does not know the tools; the client sees what the model asked for).
``StreamingToolParser`` (``streaming``) reads the same text in pieces, sending each call's name
first and its arguments as they grow.

The formats: ``hermes`` (Hermes, Qwen2.5 and Qwen3), ``llama3_json`` (Llama 3.1 to 3.3),
``mistral`` (its v3 array and v11's ``[TOOL_CALLS]name[ARGS]{...}``) and ``pythonic`` (Llama 3.2
and 4's Python-call lists). Where the detokenizer drops a marker (``<|python_tag|>`` of a tokenizer
that has it as a special token it was not asked to keep), the JSON formats also take their calls
without the marker at the start of the output.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


PARSER_NAMES = ("hermes", "llama3_json", "mistral", "pythonic")  # each a module of this package

# what a chat template writes when it shows its model's format, in the order they are looked for
TEMPLATE_SIGNS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"))


def parser_format(name: str) -> ModuleType:
    if name not in PARSER_NAMES:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}")


def parser_from_template(template: str | None) -> str | None:
    """The parser a chat template shows its model's calls in; None when it shows none."""
    return next((name for sign, name in TEMPLATE_SIGNS if template and sign in template), None)


def auto_tool_parser(enabled: bool, given: str | None, template: str | None) -> str | None:
    """The parser of tool_choice "auto" (None: "auto" is refused): ``--tool-call-parser``, else the
    chat template's; ``ValueError`` when enabled with neither."""
    if not enabled:
        return None
    name = given or parser_from_template(template)
    if name is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(PARSER_NAMES)}): the chat "
                         "template does not show which format the model writes its tool calls in")
    return name


def call_start(fmt: ModuleType, text: str, at_start: bool = True) -> int | None:
    """Where the calls start in ``text``: a marker, or an ``AT_START`` one unless ``at_start`` is
    false (``text`` is not the output's start)."""
    if fmt.AT_START and at_start:
        first = len(text) - len(text.lstrip())
        if any(text.startswith(s, first) for s in fmt.AT_START):
            return first
    found = [at for at in (text.find(m) for m in fmt.MARKERS) if at >= 0]
    return min(found) if found else None


READ_ERRORS = (ValueError, RecursionError, MemoryError, SyntaxError, TypeError)  # Malformed, and ast's


def parse(name: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of ``text`` in the named format (see the module's docstring)."""
    from services.frontend.tool_parsers.incremental import Reader

    fmt = parser_format(name)
    start = call_start(fmt, text)
    if start is None:
        return text, []
    reader = Reader(text[start:], eof=True)
    try:
        for _ in fmt.read(reader):  # (never yields: the text is whole)
            pass
    except READ_ERRORS:
        return text, []
    calls = [ToolCall(e[1], e[2]) for e in reader.events if e[0] == "end"]
    if not calls:
        return text, []
    return text[:start].rstrip() or None, calls


def kept_special_ids(name: str | None, tokenizer: Any, tools: bool) -> frozenset[int]:
    """The special tokens the detokenizer keeps for a request read with the named parser (when it
    has tools): those of the format's ``SPECIAL_MARKERS`` the tokenizer has as special tokens."""
    if name is None or not tools:
        return frozenset()
    return frozenset(special_ids(tokenizer, parser_format(name).SPECIAL_MARKERS))


@functools.lru_cache(maxsize=16)
def special_ids(tokenizer: Any, contents: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of the tokenizer's special added tokens whose text is one of ``contents``."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return tuple(i for i, token in decoder.items() if getattr(token, "special", False) and str(token) in contents)
