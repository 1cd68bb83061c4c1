"""The tool-call parsers (``services/frontend/tool_parsers``) on outputs written as each model family
writes them: calls told from content, several calls, content before them, malformed calls as
content; and the streaming parser, fed the same texts split at every character boundary, sending
content and calls that join to the whole-text parse."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.frontend.tool_parsers import PARSER_NAMES, ToolCall, parse, parser_from_template
from services.frontend.tool_parsers.streaming import StreamingToolParser

PARIS = ToolCall("get_weather", '{"city": "Paris", "unit": "C"}')
TOKYO = ToolCall("get_time", '{"zone": "東京"}')

# (format, the model's text, content, calls)
EXAMPLES = [
    # hermes: Qwen2.5 / Qwen3 / Hermes 3 write each call in its tags on its own lines
    ("hermes",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>', None, [PARIS]),
    ("hermes", 'Let me check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "東京"}}\n</tool_call>\n',
     "Let me check both.", [PARIS, TOKYO]),
    ("hermes", '<tool_call>{"name":"get_time","arguments":{"zone":"東京"}}</tool_call>', None, [TOKYO]),
    ("hermes", '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', None, [ToolCall("ping", "{}")]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"C\\"}"}'
               '\n</tool_call>', None, [PARIS]),  # arguments as JSON text, as some fine-tunes write them
    ("hermes", "The weather in Paris is 18 °C, <tool_ mild.", "The weather in Paris is 18 °C, <tool_ mild.", []),
    ("hermes", "Plain answer.\n", "Plain answer.\n", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, None),  # cut short
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>', None, None),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call> and then I will answer.',
     None, None),  # text after the calls
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', None, None),  # no name
    ("hermes", '<tool_call>\n{"name": "unknown_tool", "arguments": {"a": [1, 2]}}\n</tool_call>', None,
     [ToolCall("unknown_tool", '{"a": [1, 2]}')]),  # kept, as vLLM keeps it
    # llama3_json: Llama 3.1-3.3 (the python tag is a special token: usually dropped from the text)
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}; '
                    '{"name": "get_time", "parameters": {"zone": "東京"}}', None, [PARIS, TOKYO]),
    ("llama3_json", 'Sure.<|python_tag|>{"name": "get_time", "arguments": {"zone": "東京"}}', "Sure.", [TOKYO]),
    ("llama3_json", '  {"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}\n', None, [PARIS]),
    ("llama3_json", 'Use {"name": "x"} like this.', 'Use {"name": "x"} like this.', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}; {"name"', None, None),
    ("llama3_json", '{"city": "Paris"}', None, None),  # JSON, but not a call
    # mistral: Mistral 7B v0.3, Nemo, Small
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}, '
                '{"name": "get_time", "arguments": {"zone": "東京"}}]', None, [PARIS, TOKYO]),
    ("mistral", 'I will look it up. [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "東京"}}]',
     "I will look it up.", [TOKYO]),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]', None, [PARIS]),
    ("mistral", "[1] is the first footnote [TOOL", "[1] is the first footnote [TOOL", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}', None, None),
    ("mistral", '[TOOL_CALLS]{"name": "get_weather", "arguments": {}}', None, None),  # not an array
    # pythonic: Llama 3.2 / 4, ToolACE
    ("pythonic", '[get_weather(city="Paris", unit="C"), get_time(zone="東京")]', None, [PARIS, TOKYO]),
    ("pythonic", "[f(x=1, y=[1.5, None, True], z={'k': 'v'})]", None,
     [ToolCall("f", '{"x": 1, "y": [1.5, null, true], "z": {"k": "v"}}')]),
    ("pythonic", "[ping()]\n", None, [ToolCall("ping", "{}")]),
    ("pythonic", "[1] Paris is the capital.", None, None),
    ("pythonic", '[get_weather("Paris")]', None, None),  # positional arguments
    ("pythonic", "[get_weather(city=os.environ)]", None, None),  # not a literal
    ("pythonic", "[get_weather(city=__import__('os').getcwd())]", None, None),
    ("pythonic", '[get_weather(city="Par', None, None),
    ("pythonic", "The answer is 4.", "The answer is 4.", []),
]


def expected(text: str, content: str | None, calls: list[ToolCall] | None) -> tuple[str | None, list[ToolCall]]:
    return (text, []) if calls is None else (content, calls)  # None: malformed, all of it content


@pytest.mark.parametrize("name, text, content, calls", EXAMPLES)
def test_parse(name, text, content, calls):
    assert parse(name, text) == expected(text, content, calls)


def streamed(name: str, pieces: list[str], first_only: bool = False) -> tuple[str | None, list[ToolCall], list]:
    """The deltas' content joined and their calls, as a client accumulates them; the deltas."""
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
                calls[call["index"]][1] += call["function"]["arguments"]
        if "tool_calls" in delta:
            assert all("content" not in d for d in deltas[deltas.index(delta):])  # content comes first
    return content or None, [ToolCall(n, a) for n, a in calls.values()], deltas


def whole(name: str, text: str) -> tuple[str | None, list[ToolCall]]:
    content, calls = parse(name, text)
    return (content or None), calls


@pytest.mark.parametrize("name, text, content, calls", EXAMPLES)
def test_streamed_deltas_join_to_the_parse_split_anywhere(name, text, content, calls):
    want = whole(name, text)
    for pieces in ([text], list(text), *([text[:i], text[i:]] for i in range(1, len(text)))):
        assert streamed(name, pieces)[:2] == want, pieces
    for i, j in itertools.combinations(range(1, len(text), 3), 2):
        assert streamed(name, [text[:i], text[i:j], text[j:]])[:2] == want, (i, j)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(EXAMPLES), st.lists(st.integers(0, 400), max_size=12), st.text(max_size=8))
def test_streamed_any_split_and_any_text_before(example, cuts, before):
    name, text = example[0], before + example[1]
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    assert streamed(name, pieces)[:2] == whole(name, text)


def test_content_before_a_call_streams_before_the_calls_finish():
    name, text = "hermes", EXAMPLES[1][1]
    parser = StreamingToolParser(name, lambda: "id")
    early = [d for ch in text[:text.index("<tool_call>") + 3] for d in parser.feed(ch)]
    assert "".join(d["content"] for d in early) == "Let me check both."  # the whitespace and "<to" held back
    assert [d for ch in text[len("Let me check both.") + 5:] for d in parser.feed(ch)] == []
    assert [d["tool_calls"][0]["function"] for d in parser.finish()] == [
        {"name": "get_weather", "arguments": ""}, {"arguments": PARIS.arguments},
        {"name": "get_time", "arguments": ""}, {"arguments": TOKYO.arguments}]


def test_first_only_keeps_the_first_call():
    content, calls, deltas = streamed("hermes", [EXAMPLES[1][1]], first_only=True)
    assert (content, calls) == ("Let me check both.", [PARIS]) and len(deltas) == 3


def test_the_parser_a_template_shows():
    assert parser_from_template("{% for tool in tools %}<tools>{{ tool }}</tools>{% endfor %} <tool_call>") == "hermes"
    assert parser_from_template("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_from_template("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert parser_from_template("{{ messages }}") is None and parser_from_template(None) is None
    assert set(PARSER_NAMES) == {"hermes", "llama3_json", "mistral", "pythonic"}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(PARSER_NAMES),
       st.text(alphabet=st.sampled_from(list('<>[]{}(),;:"=_ \n|/tool_cal')), max_size=40))
def test_never_raises(name, text):
    content, calls = parse(name, text)
    assert calls or content == text
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)
    assert streamed(name, list(text))[:2] == whole(name, text)


@pytest.mark.parametrize("name", PARSER_NAMES)
def test_a_long_answer_streams_as_it_comes(name):
    """Plain text goes out piece by piece, holding back no more than a marker's length (a long
    answer costs each piece the piece, not the text so far)."""
    parser = StreamingToolParser(name, lambda: "id")
    sent = ""
    for i in range(2000):
        sent += "".join(d["content"] for d in parser.feed(f"Word {i} <tool [TOOL <|python "))
        assert len(parser._tail) <= len("<|python_tag|>")
    sent += "".join(d["content"] for d in parser.finish())
    assert sent == "".join(f"Word {i} <tool [TOOL <|python " for i in range(2000))
