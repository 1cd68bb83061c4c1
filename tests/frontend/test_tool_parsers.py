"""The tool-call parsers (``services/frontend/tool_parsers``) on outputs written as each model family
writes them: calls told from content, several calls, content before them, malformed calls as
content, the arguments as the model wrote them. The streaming parser, fed the same texts in any
pieces (the tool-call streaming tests: ``test_tool_streaming``), is checked in that module."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.frontend.tool_parsers import PARSER_NAMES, ToolCall, parse, parser_from_template

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
    # mistral, v11+ tokenizers (Mistral Small 3.1+, Magistral, Devstral): [TOOL_CALLS]name[ARGS]{...} per call
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}', None, [PARIS]),
    ("mistral", 'Both.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}[TOOL_CALLS]get_time[ARGS]'
                '{"zone": "東京"}', "Both.", [PARIS, TOKYO]),
    ("mistral", '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"zone": "東京"}', None, [TOKYO]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', None, None),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} and more', None, None),
    ("mistral", "[TOOL_CALLS]get weather[ARGS]{}", None, None),
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


def expected(text: str, content: str | None, calls: list[ToolCall] | None) -> tuple[str | None, list]:
    return (text, []) if calls is None else (content, calls)  # None: malformed, all of it content


def meaning(parsed: tuple[str | None, list[ToolCall]]) -> tuple[str | None, list]:
    """Content and calls, each call's arguments as their JSON value."""
    return parsed[0], [(c.name, json.loads(c.arguments)) for c in parsed[1]]


@pytest.mark.parametrize("name, text, content, calls", EXAMPLES)
def test_parse(name, text, content, calls):
    parsed = parse(name, text)
    assert meaning(parsed) == meaning(expected(text, content, calls))
    for call in parsed[1]:  # the arguments as written (an object's text; pythonic's made from its literals)
        assert (call.arguments in text) == (name != "pythonic" and '"arguments": "' not in text), call


def test_the_parser_a_template_shows():
    assert parser_from_template("{% for tool in tools %}<tools>{{ tool }}</tools>{% endfor %} <tool_call>") == "hermes"
    assert parser_from_template("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_from_template("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert parser_from_template("{{ messages }}") is None and parser_from_template(None) is None
    assert set(PARSER_NAMES) == {"hermes", "llama3_json", "mistral", "pythonic"}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(PARSER_NAMES),
       st.text(alphabet=st.sampled_from(list('<>[]{}(),;:"=_ \n|/tool_calARGS\\')), max_size=40))
def test_never_raises(name, text):
    content, calls = parse(name, text)
    assert calls or content == text
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)
