"""Guide specs as llguidance grammars. A spec is one of ``{"json_object": true}`` (any JSON object),
``{"json_schema": S}`` (a value valid against the JSON schema S, ``pattern`` and ``format``
included where llguidance supports them), ``{"choice": [texts]}`` (exactly one of them),
``{"regex": R}`` (a text the regex matches whole, Rust ``regex`` syntax) or ``{"grammar": G}`` (a
context-free grammar: GBNF as llama.cpp and vLLM write it, or llguidance's Lark; llguidance tells
them apart by GBNF's ``::=``); ``"whitespace": false`` beside a JSON guide writes it compact.

``compile_guide`` returns the grammar (llguidance's JSON text) once ``LLMatcher.
validate_grammar_with_warnings`` takes it, else raises ``ValueError`` with llguidance's message
(first line, trimmed, which says where). JSON guides bound the blanks between tokens to
``MAX_BLANKS`` so that a model cannot pad forever; a spec's text is at most ``MAX_GUIDE_BYTES``.
"""

from __future__ import annotations

import json
from typing import Any

MAX_GUIDE_BYTES = 64 * 1024  # a spec's JSON text (a schema, a regex, a grammar)
MAX_BLANKS = 32  # blanks between two JSON tokens
MAX_MESSAGE = 300  # characters of llguidance's message kept in an error
_GBNF_FAILED = "Failed to convert the grammar from GBNF to Lark: "
KINDS = ("json_object", "json_schema", "choice", "regex", "grammar")
_FLEXIBLE = {"whitespace_flexible": True, "whitespace_pattern": f"[ \\t\\n\\r]{{0,{MAX_BLANKS}}}",
             "json_allow_general_unicode_escapes": True}  # "\\u00e9" as json.dumps writes it
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":",
            "json_allow_general_unicode_escapes": True}


def _read(spec: Any) -> tuple[str, Any, bool]:
    if isinstance(spec, (str, bytes)):
        size = len(spec.encode() if isinstance(spec, str) else spec)
        if size > MAX_GUIDE_BYTES:
            raise ValueError(f"the guide is {size} bytes, over the limit of {MAX_GUIDE_BYTES} bytes")
        spec = json.loads(spec)
    if not isinstance(spec, dict):
        raise ValueError(f"a guide is one of {', '.join(KINDS)}")
    spec = dict(spec)
    whitespace = spec.pop("whitespace", True)
    if not isinstance(whitespace, bool):
        raise ValueError(f"whitespace must be true or false, got {whitespace!r}")
    if len(spec) != 1:
        raise ValueError(f"a guide is one of {', '.join(KINDS)}")
    (kind, value), = spec.items()
    if kind not in KINDS:
        raise ValueError(f"unknown guide {kind!r}: one of {', '.join(KINDS)}")
    return kind, value, whitespace


def to_grammar(spec: Any) -> str:
    """The llguidance grammar (JSON text) of ``spec`` (a dict or its JSON text), unvalidated."""
    import llguidance

    kind, value, whitespace = _read(spec)
    if kind in ("json_object", "json_schema"):
        schema = {"type": "object"} if kind == "json_object" else value
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema is an object")
        # overrides: a schema's own "x-guidance" cannot lift the bound on blanks
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_FLEXIBLE if whitespace else _COMPACT)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("choice is a non-empty list of non-empty strings")
        return llguidance.grammar_from("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise ValueError(f"{kind} is a non-empty string")
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    try:
        return llguidance.grammar_from("gbnf", value)  # Lark passes through as it is
    except Exception as exc:  # noqa: BLE001 - the GBNF converter raises ValueError, or bare Exceptions
        raise ValueError("GBNF: " + _first_line(str(exc).removeprefix(_GBNF_FAILED))) from None


def compile_guide(spec: Any) -> str:
    """``spec``'s llguidance grammar once llguidance takes it; raises ``ValueError`` saying why not
    (a panic inside llguidance too: pyo3 raises it as a ``BaseException``)."""
    import llguidance

    try:
        grammar = to_grammar(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, RecursionError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - pyo3_runtime.PanicException on odd schemas
        raise ValueError(f"llguidance cannot read the guide: {_first_line(str(exc))}") from None
    if is_error:
        raise ValueError(_first_line(messages[0] if messages else "llguidance refused the guide"))
    return grammar


def _first_line(message: str) -> str:
    """llguidance's message, one line: its first, with the regex parser's ``error: ...`` line when
    the first only introduces it."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    text = lines[0] if lines else message.strip()
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    if detail is not None and text.endswith(":"):
        text = f"{text} {detail[len('error:'):].strip()}"
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."
