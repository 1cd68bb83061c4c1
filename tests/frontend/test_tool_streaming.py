"""The streaming tool-call parser (``tool_parsers.streaming``) on the outputs of
``test_tool_parsers``' examples, fed in any pieces: a client accumulating its deltas as OpenAI's
stream is accumulated gets ``parse``'s content and calls for every well-formed output and every
output that breaks before a call is sent; the result never depends on how the text was split;
each call's name comes first and long arguments come in pieces; what a break after a sent call
leaves is what the module documents. Fed token by token through the detokenizer of a byte-level
tokenizer (tags and multi-byte characters split across tokens), too."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.tool_parsers import PARSER_NAMES, ToolCall, parse
from services.frontend.tool_parsers.streaming import StreamingToolParser
from tests.frontend.test_tool_parsers import EXAMPLES

WELL_FORMED = [e for e in EXAMPLES if e[3] is not None]
MALFORMED = [e for e in EXAMPLES if e[3] is None]
# a call with a long argument, in each format
LONG = "Paris, " * 40 + "東京 🚀"
LONG_CALLS = {
    "hermes": f'<tool_call>\n{{"name": "say", "arguments": {{"text": "{LONG}", "n": [1, 2.5e3, true, null]}}}}\n'
              '</tool_call>',
    "llama3_json": f'<|python_tag|>{{"name": "say", "parameters": {{"text": "{LONG}", "n": [1, 2.5e3, true, null]}}}}',
    "mistral": f'[TOOL_CALLS]say[ARGS]{{"text": "{LONG}", "n": [1, 2.5e3, true, null]}}',
    "pythonic": f'[say(text="{LONG}", n=[1, 2.5e3, True, None])]',
}


def streamed(name: str, pieces: list[str], first_only: bool = False):
    """``(content or None, calls, made_calls, deltas)`` as a client accumulates the deltas."""
    ids = (f"call-{i}" for i in itertools.count())
    parser = StreamingToolParser(name, lambda: next(ids), first_only)
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
    content, calls = "", {}
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}), delta
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:  # a call's first delta: its header
                assert call["index"] == len(calls) and call["type"] == "function"
                assert call["function"]["arguments"] == ""
                calls[call["index"]] = [call["function"]["name"], ""]
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                assert call["function"]["arguments"] and call["index"] == len(calls) - 1  # the open call's
                calls[call["index"]][1] += call["function"]["arguments"]
    return content or None, [ToolCall(n, a) for n, a in calls.values()], parser.made_calls, deltas


def splits(text: str):
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(1, len(text), 5), 2):
        yield [text[:i], text[i:j], text[j:]]


@pytest.mark.parametrize("name, text, content, calls", WELL_FORMED + [e for e in MALFORMED if e[0] == "pythonic"])
def test_a_well_formed_stream_is_the_parse_split_anywhere(name, text, content, calls):
    """(A pythonic call is sent whole, once its parenthesis closes: its malformed outputs break
    before anything is sent.)"""
    want = parse(name, text)
    for pieces in splits(text):
        assert streamed(name, pieces)[:3] == (*want, bool(want[1])), pieces


@pytest.mark.parametrize("name, text, content, calls", MALFORMED)
def test_a_malformed_stream_keeps_what_it_sent_whatever_the_split(name, text, content, calls):
    one = streamed(name, [text])
    got_content, got_calls, made_calls, _ = one
    if not got_calls:  # broke before a call went out: parse's answer, all of it content
        assert (got_content, made_calls) == (text, False)
    else:  # what was sent stays; the rest is content; no character sent twice
        assert all(call.arguments in text for call in got_calls)
        assert got_content is None or text.endswith(got_content)
        assert len(got_content or "") + sum(len(c.arguments) for c in got_calls) < len(text)
        assert got_content or not made_calls  # text after whole calls, or calls cut short
        assert all(_is_object(c.arguments) for c in got_calls) or not made_calls  # tool_calls: whole calls only
    for pieces in splits(text):
        assert streamed(name, pieces)[:3] == one[:3], pieces


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_a_long_argument_streams_in_pieces_after_the_name(name):
    text = "Here it is: " + LONG_CALLS[name] if name in ("hermes", "mistral") else LONG_CALLS[name]
    [call] = parse(name, text)[1]
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    content, calls, made_calls, deltas = streamed(name, pieces)
    assert (content, calls, made_calls) == (parse(name, text)[0], [call], True)
    argument_deltas = [d for d in deltas if "tool_calls" in d and "id" not in d["tool_calls"][0]]
    header = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert deltas[header]["tool_calls"][0]["function"]["name"] == "say"
    assert all(deltas.index(d) > header for d in argument_deltas)
    if name == "pythonic":  # its arguments are known when the call closes: one piece
        assert len(argument_deltas) == 1
    else:  # as they come: about one per piece fed
        assert len(argument_deltas) > len(LONG) // 3 // 2


@pytest.mark.parametrize("name, text, content, calls", [e for e in WELL_FORMED if "東京" in e[1]])
def test_token_by_token_through_the_detokenizer(model, name, text, content, calls):
    """A byte-level tokenizer splits the tags and 東京's bytes across tokens; the detokenizer holds
    a partial character back, and the parser, fed what it releases, gives the parse."""
    tokenizer = model.tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # a character split across tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add([i]) for i in ids] + [detokenizer.finish()]
    assert "".join(pieces) == text and len(pieces) > 8
    assert streamed(name, pieces)[:2] == parse(name, text)


def test_content_comes_before_the_call_and_the_arguments_before_it_ends():
    name, text = "hermes", EXAMPLES[1][1]
    parser = StreamingToolParser(name, lambda: "id")
    opened = text.index('{"city"') + 5
    early = [d for ch in text[:text.index("<tool_call>") + 3] for d in parser.feed(ch)]
    assert "".join(d["content"] for d in early) == "Let me check both."  # the whitespace and "<to" held back
    later = [d for ch in text[len("Let me check both.") + 5:opened] for d in parser.feed(ch)]
    assert later[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in later[1:]) == '{"cit'


def test_first_only_sends_the_first_call():
    content, calls, made_calls, deltas = streamed("hermes", [EXAMPLES[1][1]], first_only=True)
    assert (content, calls, made_calls) == ("Let me check both.", parse("hermes", EXAMPLES[1][1])[1][:1], True)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(EXAMPLES), st.lists(st.integers(0, 400), max_size=12), st.text(max_size=8))
def test_any_split_and_any_text_before(example, cuts, before):
    name, text = example[0], before + example[1]
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    result = streamed(name, pieces)[:3]
    assert result == streamed(name, [text])[:3]
    if parse(name, text)[1] or not result[1]:
        assert result[:2] == parse(name, text)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(PARSER_NAMES),
       st.text(alphabet=st.sampled_from(list('<>[]{}(),;:"=_ \n|/tool_calARGS\\')), max_size=40))
def test_random_text_splits_the_same_and_never_raises(name, text):
    assert streamed(name, list(text))[:3] == streamed(name, [text])[:3]


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_a_long_answer_streams_as_it_comes(name):
    """Plain text goes out piece by piece, holding back no more than a marker's length."""
    parser = StreamingToolParser(name, lambda: "id")
    sent = ""
    for i in range(2000):
        sent += "".join(d["content"] for d in parser.feed(f"Word {i} <tool [TOOL <|python "))
        assert len(parser._tail) <= len("<|python_tag|>")
    sent += "".join(d["content"] for d in parser.finish())
    assert sent == "".join(f"Word {i} <tool [TOOL <|python " for i in range(2000))
