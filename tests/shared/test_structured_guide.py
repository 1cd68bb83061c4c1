"""Guide specs as llguidance grammars (``shared.structured``) alone: which texts a spec takes, checked
byte by byte through an ``llguidance.LLMatcher`` against references no one here wrote (Python's
``re`` for regexes, ``json.loads`` and ``jsonschema`` for schemas, ``ast`` for an arithmetic
grammar); and the specs refused, with llguidance's message saying where."""

from __future__ import annotations

import ast
import functools
import json
import random
import re

import jsonschema
import pytest

from shared.structured import MAX_BLANKS, MAX_GUIDE_BYTES, compile_guide

# GBNF as llama.cpp writes it: sums and products of integers, bracketed; Python's ``ast`` parses it
ARITHMETIC = r'''
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= "0" | [1-9] [0-9]{0,2} | "(" expr ")"
'''


@functools.lru_cache(maxsize=1)
def _vocabulary():
    from services.executor.guided import vocabulary_of
    from tests.doubles.fake_scheduler import cached_tokenizer

    tokenizer = cached_tokenizer()
    return vocabulary_of(tokenizer, len(tokenizer))


def _matcher(grammar: str, data: bytes):
    import llguidance

    vocabulary = _vocabulary()
    matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0)
    matcher.consume_tokens(vocabulary.tokenize_bytes(data))
    return matcher


def complete(grammar: str, text: str | bytes) -> bool:
    """The guide (``compile_guide``'s grammar) takes ``text`` whole."""
    matcher = _matcher(grammar, text if isinstance(text, bytes) else text.encode())
    return not matcher.is_error() and matcher.is_accepting()


def live(grammar: str, text: str | bytes) -> bool:
    """``text`` starts something the guide takes."""
    return not _matcher(grammar, text if isinstance(text, bytes) else text.encode()).is_error()


def test_a_regex_takes_exactly_what_re_fullmatch_takes():
    pattern = r"(ab|c)[0-9]{2,3}-?[é€😀x]*"
    guide = compile_guide({"regex": pattern})
    rng = random.Random(0)
    def pick(options: str, most: int) -> str:
        return "".join(rng.choice(options) for _ in range(rng.randint(0, most)))

    texts = [rng.choice(["ab", "c", "a", "", "bc"]) + pick("0129", 4) + pick("-", 2) + pick("é€😀xa", 3)
             for _ in range(300)]
    assert 20 <= sum(bool(re.fullmatch(pattern, t)) for t in texts) <= 280  # both answers are checked
    for text in texts:
        assert complete(guide, text) == bool(re.fullmatch(pattern, text)), text


def test_a_gbnf_grammar_takes_what_python_parses_as_arithmetic():
    guide = compile_guide({"grammar": ARITHMETIC})
    rng = random.Random(1)
    texts = ["".join(rng.choice("12+*(/)-") for _ in range(rng.randint(1, 9))) for _ in range(300)]
    taken = [t for t in texts if complete(guide, t)]
    assert len(taken) >= 10 and complete(guide, "(1+22)*333/4")
    for text in taken:  # every sentence of the grammar is an expression Python parses
        assert isinstance(ast.parse(text, mode="eval").body, (ast.BinOp, ast.Constant)), text
    assert not complete(guide, "1+") and not complete(guide, "(1") and live(guide, "(1")


def test_lark_grammars_pass_too():
    guide = compile_guide({"grammar": 'start: "yes" | "no" NUM\nNUM: /[0-9]+/'})
    assert complete(guide, "yes") and complete(guide, "no42") and not complete(guide, "no")


def test_json_schemas_with_pattern_and_format_take_only_valid_instances():
    schema = {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]+$"},
        "when": {"type": "string", "format": "date"},
        "mail": {"type": "string", "format": "email"},
        "n": {"type": "integer", "minimum": 0}}, "required": ["code", "when"], "additionalProperties": False}
    guide = compile_guide({"json_schema": schema})
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    docs = [{"code": "AB12", "when": "2024-02-29"}, {"code": "AB12", "when": "2024-02-29", "mail": "a@b.io", "n": 3},
            {"code": "ab12", "when": "2024-02-29"}, {"code": "AB", "when": "2024-01-01"},
            {"code": "AB1", "when": "yesterday"}, {"code": "AB1", "when": "2024-13-01"},
            {"code": "AB1", "when": "2024-01-01", "n": -1}, {"code": "AB1", "when": "2024-01-01", "x": 1},
            {"code": "AB1"}]
    for doc in docs:
        valid = checker.is_valid(doc)
        assert complete(guide, json.dumps(doc)) == valid, doc
        assert complete(guide, json.dumps(doc, indent=2)) == valid, doc


def test_json_object_takes_objects_and_blanks_are_bounded():
    guide = compile_guide({"json_object": True})
    assert complete(guide, '{"a": [1, 2.5e3, "\\u00e9\\n", null, true]}') and not complete(guide, "[1]")
    blanks = " " * MAX_BLANKS
    assert complete(guide, '{"a":' + blanks + "1}")
    assert not live(guide, '{"a":' + blanks + " ")  # a model cannot pad forever
    compact = compile_guide({"json_object": True, "whitespace": False})
    assert complete(compact, '{"a":[1,2]}') and not live(compact, '{"a": ')
    assert not live(compile_guide({"json_schema": {"type": "object", "x-guidance": {"whitespace_pattern": " *"}}}),
                    '{' + " " * (MAX_BLANKS + 1))  # a schema's own options cannot lift the bound


def test_mid_utf8_bytes_are_live_and_only_whole_characters_complete():
    guide = compile_guide({"json_schema": {"type": "string", "maxLength": 3}})
    assert live(guide, b'"\xe2\x82') and not complete(guide, b'"\xe2\x82"')
    assert complete(guide, '"€😀é"') and not complete(guide, '"€😀éa"')


def test_choices_are_raw_texts():
    guide = compile_guide({"choice": ["Positive", 'a "quoted" one', "Pos"]})
    assert complete(guide, "Positive") and complete(guide, "Pos") and complete(guide, 'a "quoted" one')
    assert not complete(guide, '"Positive"') and not complete(guide, "Posit")


@pytest.mark.parametrize("spec, message", [
    ({"regex": "a[0-9+"}, "unclosed character class"),
    ({"regex": "(a"}, "unclosed group"),
    ({"grammar": 'root ::= "a" ( '}, "Expected ')' at line 1"),
    ({"grammar": 'root ::= "a" foo'}, "Rule 'foo' not found"),
    ({"grammar": 'start: "a" | b'}, 'at 1(8): unknown name: "b"'),
    ({"json_schema": {"type": "strin"}}, "Invalid type: strin"),
    ({"json_schema": {"type": "string", "format": "colour"}}, "Unknown format: colour"),
    ({"json_schema": {"type": "string", "pattern": "[a-"}}, "regex parse error"),
    ({"choice": []}, "non-empty list"),
    ({"regex": "a", "grammar": "b"}, "a guide is one of"),
    ({"lark": "start: a"}, "unknown guide 'lark'"),
    ({"json_object": True, "whitespace": "no"}, "whitespace must be true or false"),
    # llguidance 1.9 panics cutting this $ref's text mid-character: still a ValueError
    ({"json_schema": {"$ref": ["a" * 96 + "😍"]}}, "llguidance cannot read the guide"),
])
def test_specs_it_cannot_follow_are_refused_with_the_reason(spec, message):
    with pytest.raises(ValueError) as info:
        compile_guide(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_spec_arrives_as_json_text_within_a_size_limit():
    assert complete(compile_guide(json.dumps({"regex": "[ab]+"})), "abba")
    with pytest.raises(ValueError, match=f"over the limit of {MAX_GUIDE_BYTES} bytes"):
        compile_guide(json.dumps({"regex": "a" * MAX_GUIDE_BYTES}))
