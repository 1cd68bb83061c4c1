"""The structured-output automaton (``shared.structured``) alone: which texts a spec takes, byte by byte,
against ``json.loads`` and hand-checked instances; and the schemas it refuses."""

from __future__ import annotations

import json
import random

import pytest

from shared.structured import compile_guide
from shared.structured.guide import MAX_WS


def complete(guide, text: str | bytes) -> bool:
    state = guide.advance_bytes(guide.initial(), text if isinstance(text, bytes) else text.encode())
    return state is not None and guide.is_complete(state)


def live(guide, text: str) -> bool:
    return guide.advance_bytes(guide.initial(), text.encode()) is not None


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "null"] + (["list", "dict"] * 2 if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-5, 5)
    if kind == "str":
        return "".join(rng.choice('ab "\\\n\t/é€😀\x01') for _ in range(rng.randint(0, 6)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{rng.randint(0, 9)}": random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def test_json_object_takes_what_json_dumps_writes_and_only_objects():
    guide = compile_guide({"json_object": True})
    rng = random.Random(0)
    for _ in range(300):
        value = {"k": random_value(rng)} if rng.random() < 0.5 else random_value(rng)
        for text in (json.dumps(value), json.dumps(value, indent=2), json.dumps(value, ensure_ascii=False)):
            assert complete(guide, text) == isinstance(value, dict), text


def test_every_text_it_completes_is_a_json_object():
    """Soundness against json.loads: random edits of valid documents, kept only where the guide
    says complete, all parse (to an object)."""
    guide = compile_guide({"json_object": True})
    rng = random.Random(1)
    alphabet = '{}[]":,-+.eE0123456789 \n\\/tfnrulsabu'
    accepted = 0
    for _ in range(3000):
        text = list(json.dumps({"a": random_value(rng)}))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(text) + 1)
            edit = rng.random()
            if edit < 0.4 and text:
                text[min(at, len(text) - 1)] = rng.choice(alphabet)
            elif edit < 0.7:
                text.insert(at, rng.choice(alphabet))
            elif text:
                del text[min(at, len(text) - 1)]
        text = "".join(text)
        if complete(guide, text):
            accepted += 1
            assert isinstance(json.loads(text), dict), text
    assert accepted > 100  # the edits leave many documents valid; the check above ran on them


def test_prefixes_are_live_and_only_the_whole_is_complete():
    guide = compile_guide({"json_object": True})
    text = '{"a": [1, -2.5e+3, {"b": null}], "c": "x\\u00e9\\"", "d": true}'
    for end in range(len(text)):
        assert live(guide, text[:end])
        assert not complete(guide, text[:end]), text[:end]
    assert complete(guide, text)
    for bad in ('{"a": 01}', '{"a": 1.}', '{"a": .5}', '{"a": +1}', '{"a": tru}', '{"a": [1,]}', "{'a': 1}",
                '{"a": 1,}', '{"a"}', '{"a": "\x01"}', '{"a": "\\x"}', '{"a": NaN}', '{} '):
        assert not complete(guide, bad), bad


def test_whitespace_runs_and_digits_are_bounded():
    guide = compile_guide({"json_object": True})
    assert complete(guide, "{" + " " * MAX_WS + '"a": 1}')
    assert not live(guide, "{" + " " * (MAX_WS + 1))
    assert complete(guide, '{"a": ' + "9" * 20 + "}")
    assert not live(guide, '{"a": ' + "9" * 21)


PERSON = {
    "type": "object",
    "title": "Person",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 5, "description": "first name"},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "minItems": 1, "maxItems": 2},
        "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}], "default": None},
        "kind": {"const": "human"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
    "$defs": {"Pet": {"type": "object", "properties": {"legs": {"type": "integer"}}, "required": ["legs"]}},
}


@pytest.mark.parametrize("text", [
    '{"name": "Bob", "age": 3}',
    '{"name":"Bob","age":-3,"height":1.5e2,"tags":["a",3],"pet":{"legs":4},"kind":"human","ok":false}',
    '{"name": "Al", "age": 0, "pet": null}',
    '{"name": "éé€", "age": 1, "tags": [null]}',
    '{\n  "name": "\\n",\n  "age": 7,\n  "ok": true\n}',
])
def test_a_schema_takes_its_instances(text):
    assert complete(compile_guide({"json_schema": PERSON}), text)
    json.loads(text)


@pytest.mark.parametrize("text", [
    '{"age": 3, "name": "Bob"}',  # properties in the schema's order
    '{"name": "Bob"}',  # a required one missing
    '{"name": "", "age": 3}',  # minLength
    '{"name": "Bobbie", "age": 3}',  # maxLength
    '{"name": "Bob", "age": 3.5}',  # integer
    '{"name": "Bob", "age": 3, "tags": []}',  # minItems
    '{"name": "Bob", "age": 3, "tags": ["a", "b", "a"]}',  # maxItems
    '{"name": "Bob", "age": 3, "tags": ["c"]}',  # enum
    '{"name": "Bob", "age": 3, "pet": {}}',  # the $ref's required property
    '{"name": "Bob", "age": 3, "kind": "robot"}',  # const
    '{"name": "Bob", "age": 3, "extra": 1}',  # no other properties
    '{"name": "Bob", "age": 3, "ok": "yes"}',
    '["Bob", 3]',
])
def test_a_schema_refuses_what_breaks_it(text):
    assert not complete(compile_guide({"json_schema": PERSON}), text)


def test_recursive_references_and_unions_of_objects():
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}},
        "$ref": "#/$defs/node"}
    guide = compile_guide({"json_schema": tree})
    assert complete(guide, '{"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}, {"v": 4}]}')
    assert not complete(guide, '{"v": 1, "kids": [{"w": 2}]}')
    either = {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]}
    guide = compile_guide({"json_schema": either})
    assert complete(guide, '{"a": 1}') and complete(guide, '{"b": "x"}')
    assert not complete(guide, '{"a": "x"}') and not complete(guide, '{"b": 1}')
    assert len(guide.advance_bytes(guide.initial(), b"{")) == 2  # both alternatives open until the key
    assert complete(compile_guide({"json_schema": {"type": ["integer", "null"]}}), "null")
    assert complete(compile_guide({"json_schema": {"type": "string", "nullable": True}}), "null")


def test_free_objects_and_untyped_schemas():
    guide = compile_guide({"json_schema": {"type": "object", "additionalProperties": {"type": "integer"}}})
    assert complete(guide, '{"x": 1, "y": 2}') and not complete(guide, '{"x": "1"}')
    assert complete(compile_guide({"json_schema": {"type": "object", "additionalProperties": False}}), "{}")
    anything = compile_guide({"json_schema": {}})
    assert all(complete(anything, t) for t in ('1', '"s"', '[1, {"a": null}]', "true"))
    assert complete(compile_guide({"json_schema": {"items": {"type": "integer"}}}), "[1, 2]")


def test_numbers_at_the_root_end_where_they_may():
    guide = compile_guide({"json_schema": {"type": "number"}})
    state = guide.advance_bytes(guide.initial(), b"12")
    assert guide.is_complete(state) and guide.can_continue(state)  # more digits, or the end
    assert not complete(guide, "1.") and complete(guide, "-0.5E-3")
    literal = compile_guide({"json_schema": {"enum": [1, 10]}})
    assert complete(literal, "1") and complete(literal, "10") and not complete(literal, "100")
    done = literal.advance_bytes(literal.initial(), b"10")
    assert literal.is_complete(done) and not literal.can_continue(done)


def test_choices_are_raw_texts():
    guide = compile_guide({"choice": ["yes", "yes sir", "no"]})
    assert complete(guide, "yes") and complete(guide, "yes sir") and complete(guide, "no")
    assert not complete(guide, "ye") and not complete(guide, " yes") and not complete(guide, '"yes"')
    state = guide.advance_bytes(guide.initial(), b"yes")
    assert guide.is_complete(state) and guide.can_continue(state)


@pytest.mark.parametrize("spec, message", [
    ({"json_schema": {"type": "string", "pattern": "^a$"}}, "'pattern' is not supported"),
    ({"json_schema": {"type": "integer", "minimum": 0}}, "'minimum' is not supported"),
    ({"json_schema": {"type": "string", "format": "date"}}, "'format' is not supported"),
    ({"json_schema": {"$ref": "#/$defs/missing"}}, "points at nothing"),
    ({"json_schema": {"$ref": "http://example.com/s.json"}}, "only references inside the schema"),
    ({"json_schema": {"type": "strange"}}, "schema.type: must be one of"),
    ({"json_schema": {"type": "object", "properties": {"a": {}}, "required": ["b"]}}, "'b', which is not among"),
    ({"json_schema": {"type": "string", "minLength": 3, "maxLength": 2}}, "maxLength (2) is below minLength (3)"),
    ({"json_schema": {"type": "array", "maxItems": -1}}, "maxItems: must be a non-negative integer"),
    ({"json_schema": {"type": "object", "properties": {"a": {"pattern": "x"}}}}, "schema.properties.a: the keyword"),
    ({"json_schema": {"allOf": [{}, {}]}}, "allOf is supported only with one schema"),
    ({"json_schema": []}, "a schema must be an object"),
    ({"choice": []}, "choice: must be a non-empty list"),
    ({"choice": ["a", ""]}, "choice[1]: must be a non-empty string"),
    ({"regex": "a+"}, "unknown guide 'regex'"),
    ({"json_object": True, "choice": ["a"]}, "one of json_object, json_schema or choice"),
])
def test_specs_it_cannot_follow_are_refused_with_the_reason(spec, message):
    with pytest.raises(ValueError, match=None) as info:
        compile_guide(spec)
    assert message in str(info.value)


def test_a_spec_arrives_as_json_text():
    guide = compile_guide(json.dumps({"json_schema": {"type": "boolean"}}))
    assert complete(guide, "true") and not complete(guide, "1")


def test_strings_hold_well_formed_utf8_and_count_characters():
    guide = compile_guide({"json_schema": {"type": "string", "maxLength": 2}})
    assert complete(guide, '"é€"') and not complete(guide, '"é€x"')  # two characters, five bytes
    assert complete(guide, '"😀"')
    for bad in (b'"\x80"', b'"\xc3"', b'"\xc0\xaf"', b'"\xe0\x80\xaf"', b'"\xed\xa0\x80"', b'"\xf4\x90\x80\x80"',
                b'"\xff"', b'"\xc3\x41"'):
        assert not complete(guide, bad), bad
    half = guide.advance_bytes(guide.initial(), b'"\xe2\x82')  # a character cut between two tokens
    assert half is not None and guide.advance(half, 0x22) is None and guide.advance(half, 0xAC) is not None
    assert guide.free_string_budget(half) is None and guide.free_string_budget(guide.advance(half, 0xAC)) == 1


def test_where_a_run_of_bytes_is_well_formed_utf8():
    from shared.structured.guide import utf8_suffix_start

    assert utf8_suffix_start("abé".encode()) == 0
    assert utf8_suffix_start(b"\xa9ab") == 1  # the tail of a character cut short
    assert utf8_suffix_start(b"ab\xc3") == 0  # the head of one: the next token may finish it
    assert utf8_suffix_start(b"a\xc3Ab") == 2
    assert utf8_suffix_start(b"\xff") == 1


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}},
     "$ref": "#/$defs/a"},
])
def test_references_that_loop_before_any_value_are_refused(schema):
    with pytest.raises(ValueError, match="leads back to itself"):
        compile_guide({"json_schema": schema})


def test_deep_schemas_are_refused_not_a_recursion_error():
    deep: dict = {"type": "integer"}
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="nests deeper than 64 levels"):
        compile_guide({"json_schema": deep})
    chain = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)}, "$ref": "#/$defs/d0"}
    chain["$defs"]["d5000"] = {"type": "null"}
    with pytest.raises(ValueError, match="nests deeper"):
        compile_guide({"json_schema": chain})


def test_one_of_is_taken_only_where_no_value_matches_two_members():
    cat = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
           "required": ["kind", "lives"]}
    dog = {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
           "required": ["kind"]}
    pets = compile_guide({"json_schema": {"$defs": {"Cat": cat, "Dog": dog}, "title": "Pet",
                                          "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                                          "discriminator": {"propertyName": "kind"}}})
    assert complete(pets, '{"kind": "cat", "lives": 9}') and complete(pets, '{"kind": "dog"}')
    assert not complete(pets, '{"kind": "dog", "lives": 9}')
    assert complete(compile_guide({"json_schema": {"oneOf": [{"type": "string"}, {"type": "integer"},
                                                              {"enum": [True, None]}]}}), "null")
    for overlapping in ([{"type": "integer"}, {"type": "number"}], [{"enum": ["a", "b"]}, {"const": "b"}],
                        [{"type": "string"}, {"const": "x"}], [{"type": "object"}, {"type": "object"}], [{}, True]):
        with pytest.raises(ValueError, match="may match the same value, which oneOf forbids"):
            compile_guide({"json_schema": {"oneOf": overlapping}})


def test_enum_and_const_read_the_type_beside_them_and_refuse_other_keywords():
    assert not complete(compile_guide({"json_schema": {"type": "string", "enum": ["a", 1]}}), "1")
    assert complete(compile_guide({"json_schema": {"type": "number", "enum": ["a", 1, 2.5]}}), "2.5")
    assert complete(compile_guide({"json_schema": {"type": "string", "nullable": True, "enum": ["a", None]}}), "null")
    for schema, message in (({"enum": ["a", "bbbb"], "maxLength": 2}, "enum with 'maxLength' beside it"),
                            ({"const": "x", "enum": ["y"]}, "const and enum together"),
                            ({"type": "string", "enum": [1, 2]}, "no enum value is of the type 'string'")):
        with pytest.raises(ValueError, match=message):
            compile_guide({"json_schema": schema})


def test_array_keywords_without_a_type_make_an_array_and_closed_objects_take_blanks():
    assert not complete(compile_guide({"json_schema": {"minItems": 2}}), "[]")
    assert complete(compile_guide({"json_schema": {"minItems": 2}}), "[1, {}]")
    assert not complete(compile_guide({"json_schema": {"maxItems": 0}}), "[1]")
    closed = compile_guide({"json_schema": {"type": "object", "additionalProperties": False}})
    assert complete(closed, "{ }") and complete(closed, "{}") and not complete(closed, '{"a": 1}')


def test_pydantic_root_unions_with_definitions_beside_them():
    schema = {"$defs": {"A": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
              "anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}], "title": "MaybeA"}
    guide = compile_guide({"json_schema": schema})
    assert complete(guide, '{"x": 1}') and complete(guide, "null")


def test_ambiguity_is_bounded_and_unbounded_arrays_repeat_their_states():
    from shared.structured.guide import MAX_STACKS

    def node(extra):
        return {"type": "object", "properties": {"name": {"type": "string"}, "kids": {
            "type": "array", "items": {"$ref": "#/$defs/N"}}, **extra}, "required": ["name", "kids"]}

    guide = compile_guide({"json_schema": {"$defs": {"N": {"anyOf": [node({}), node({"size": {"type": "integer"}})]}},
                                           "$ref": "#/$defs/N"}})
    text = '{"name": "a", "kids": [' * 12
    state = guide.advance_bytes(guide.initial(), text.encode())
    assert state is not None and len(state) == MAX_STACKS  # 2 ** 12 without the bound
    closing = '{"name": "b", "kids": []}' + "]}" * 12
    assert complete(guide, text + closing) and json.loads(text + closing)
    values = compile_guide({"json_schema": {"type": "array", "items": {"type": "integer"}}})
    after = [values.advance_bytes(values.initial(), ("[" + "1, " * n).encode()) for n in (5, 50, 500)]
    assert after[0] == after[1] == after[2]  # the count of an unbounded array is not kept
    bounded = compile_guide({"json_schema": {"type": "array", "items": {"type": "integer"}, "maxItems": 600}})
    assert len({bounded.advance_bytes(bounded.initial(), ("[" + "1, " * n).encode()) for n in (5, 50)}) == 2


def test_unicode_escapes_spell_characters():
    guide = compile_guide({"json_schema": {"type": "string", "minLength": 2}})
    assert not complete(guide, '"\\ud83d\\ude00"')  # one character (a surrogate pair): below minLength
    assert complete(guide, '"\\ud83d\\ude00x"') and complete(guide, '"\\u00e9\\uD7FF"')
    assert json.loads('"\\ud83d\\ude00x"') == "😀x"
    for bad in ('"\\udc00x"', '"\\ud83dxx"', '"\\ud83d\\u0041"', '"\\uDBFF\\n"', '"\\u12"', '"\\u12g4"'):
        assert not complete(guide, bad), bad
    assert live(guide, '"\\uD8') and not live(guide, '"\\uDC')  # refused at the first byte that dooms it


def test_a_compact_guide_writes_no_blanks():
    guide = compile_guide({"json_object": True, "whitespace": False})
    assert complete(guide, '{"a":[1,{"b":null}]}') and complete(guide, '{"a":" x "}')  # blanks in strings stay
    for spaced in ('{ "a":1}', '{"a": 1}', '{"a":[1, 2]}', ' {}'):
        assert not complete(guide, spaced), spaced
    with pytest.raises(ValueError, match="whitespace must be true or false"):
        compile_guide({"json_object": True, "whitespace": "no"})
