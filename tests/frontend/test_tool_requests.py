"""Tool calling on /v1/chat/completions, the request side (``services/frontend/tools.py``): ``tools``
and ``tool_choice`` read, defaulted and refused with a 400 naming them; the guide a named or
"required" choice sends the engine; a tool conversation's messages as the chat template gets them.
The responses are tested in ``test_tool_calls.py``."""

from __future__ import annotations

import copy
import re

import pytest

from services.frontend.preprocess import chat_prompt_ids
from services.frontend.served_model import ServedModel
from services.frontend.tools import NO_PARAMETERS, ToolChoice, required_schema
from shared.structured import compile_guide
from tests.frontend.test_fields import chat, refused
from tests.shared.test_structured_guide import complete
from tests.frontend.test_structured_request import SCHEMA, guided

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                      "unit": {"enum": ["C", "F"]}},
                      "required": ["city"], "additionalProperties": False}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"],
                   "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": WEATHER_PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS, "strict": True}}
TOOLS = [WEATHER, TIME]
CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
AUTO_REASON = ('"auto" tool choice needs a tool-call parser, which this server was started without '
               '(--enable-auto-tool-choice, with --tool-call-parser when the chat template does not show the '
               'format): use tool_choice "required" or a named function, or "none"')


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def weather_conforms(arguments: dict) -> bool:
    return (isinstance(arguments, dict) and set(arguments) <= {"city", "unit"}
            and isinstance(arguments.get("city"), str) and len(arguments["city"]) <= 12
            and arguments.get("unit", "C") in ("C", "F"))


def time_conforms(arguments: dict) -> bool:
    return (isinstance(arguments, dict) and set(arguments) == {"zone"} and isinstance(arguments["zone"], str)
            and len(arguments["zone"]) <= 6)


# ---------------------------------------------------------------- tools and tool_choice read


def test_tool_choice_defaults_to_none_without_tools_and_none_keeps_the_tools(model):
    for fields in ({}, {"tools": None}, {"tools": []}, {"tool_choice": "none"}, {"tools": [], "tool_choice": "none"}):
        body = chat(**fields)
        assert (body.tools, body.tool_choice, guided(body, model)) == ([], ToolChoice("none"), None), fields
    body = chat(tools=TOOLS + [{"function": {"name": "no-params_1"}}], tool_choice="none")
    assert body.tool_choice == ToolChoice("none") and guided(body, model) is None
    assert body.tools == [  # OpenAI's shape for the template; strict dropped, parameters filled in, type defaulted
        WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
        {"type": "function", "function": {"name": "no-params_1", "parameters": NO_PARAMETERS}},
    ]
    assert chat(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"}, n=2).tools == TOOLS[:1] + [
        {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}}]
    assert guided(chat(tools=TOOLS, tool_choice="none", guided_json=SCHEMA), model) == {"json_schema": SCHEMA}
    assert chat(tools=TOOLS, tool_choice="none", use_beam_search=True, n=2).options.use_beam_search


def test_auto_is_refused_with_the_reason_given_or_defaulted():
    error = refused(lambda: chat(tools=TOOLS), "tool_choice", AUTO_REASON, "the default when tools are given")
    assert error.message.startswith('tool_choice "auto" (the default when tools are given): ')
    error = refused(lambda: chat(tools=TOOLS, tool_choice="auto"), "tool_choice", AUTO_REASON)
    assert "default" not in error.message


@pytest.mark.parametrize("tools, fragments", [
    ("get_weather", ["tools must be a list of tools, got string"]),
    ({"type": "function"}, ["tools must be a list of tools, got object"]),
    ([WEATHER] * 129, ["tools takes at most 128 tools, got 129"]),
    (["get_weather"], ["tools[0] must be an object, got string"]),
    ([WEATHER, {"type": "custom", "custom": {"name": "x"}}],
     ['tools[1].type must be "function" (only function tools are supported), got string "custom"']),
    ([{"type": "function"}], ["tools[0].function must be an object, got nothing"]),
    ([{"type": "function", "function": "get_weather"}], ["tools[0].function must be an object, got string"]),
    ([{"type": "function", "function": {"description": "x"}}], ["tools[0].function.name must be 1 to 64", "nothing"]),
    ([{"type": "function", "function": {"name": "get weather"}}], ["letters, digits, _ or -", '"get weather"']),
    ([{"type": "function", "function": {"name": "a" * 65}}], ["tools[0].function.name must be 1 to 64"]),
    ([{"type": "function", "function": {"name": ""}}], ["tools[0].function.name must be 1 to 64"]),
    ([{"type": "function", "function": {"name": "f\n"}}], ["tools[0].function.name must be 1 to 64"]),
    ([WEATHER, TIME, WEATHER], ["tools[2].function.name: get_weather names two tools; tool names must be unique"]),
    ([{"type": "function", "function": {"name": "f", "description": 3}}],
     ["tools[0].function.description must be a string, got number"]),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}],
     ["tools[0].function.strict must be a boolean, got string"]),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     ["tools[0].function.parameters must be a JSON schema (an object), got string"]),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     ["tools[1].function.parameters must describe an object (arguments are a JSON object)"]),
])
def test_malformed_tools_are_refused_naming_tools(tools, fragments):
    refused(lambda: chat(tools=tools, tool_choice="none"), "tools", *fragments)


def test_only_the_called_tools_schemas_must_be_ones_the_guide_follows():
    """A tool the request does not call may use keywords the guide cannot follow (a format llguidance
    does not know): the chat template reads them; the guide compiles only what it follows."""
    loose = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"day": {"type": "string", "format": "stardate"}, "n": {"type": "integer",
                                                                                                  "minimum": 1}}}}}
    gone = {"type": "function", "function": {"name": "g", "parameters": {"$ref": "#/$defs/Gone"}}}
    for choice in ("none", named("get_weather")):
        assert chat(tools=[WEATHER, loose, gone], tool_choice=choice).tools[1]["function"]["name"] == "f"
    refused(lambda: chat(tools=[WEATHER, loose], tool_choice=named("f")), "tools",
            "tools[1].function.parameters: ", "Unknown format: stardate")  # llguidance's own words follow
    refused(lambda: chat(tools=[WEATHER, gone], tool_choice="required"), "tools",
            "tools[1].function.parameters: ", "Pointer '/$defs/Gone' does not exist")
    empty = {"type": "function", "function": {"name": "e", "parameters": {}}}  # {}: an object, as left out
    assert chat(tools=[empty], tool_choice=named("e")).options.tool_guide == {
        "json_schema": {"type": "object", "properties": {}}}


@pytest.mark.parametrize("fields, fragments", [
    ({"tools": TOOLS, "tool_choice": "any"}, ['tool_choice must be "none", "auto", "required" or {"type": '
                                              '"function", "function": {"name": ...}}, got string "any"']),
    ({"tools": TOOLS, "tool_choice": 1}, ["tool_choice must be", "got number 1"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, ["tool_choice must be", "got object"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": 3}}}, ["tool_choice must be"]),
    ({"tools": TOOLS, "tool_choice": {"type": "custom", "custom": {"name": "get_time"}}}, ["tool_choice must be"]),
    ({"tools": TOOLS, "tool_choice": named("get_news")},
     ["tool_choice names the function 'get_news', which is not among the tools (get_weather, get_time)"]),
    ({"tool_choice": "required"}, ['tool_choice "required" needs tools: give tools, or leave tool_choice out']),
    ({"tools": [], "tool_choice": named("get_time")}, ["tool_choice naming get_time needs tools"]),
    ({"tool_choice": "auto"}, ['tool_choice "auto" needs tools']),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     ['tool_choice "required" cannot be combined with response_format: both guide the output (one guide per '
      'request); tool_choice "none" keeps the tools and lets response_format guide it']),
    ({"tools": TOOLS, "tool_choice": named("get_time"), "guided_json": SCHEMA},
     ["tool_choice naming get_time cannot be combined with guided_json"]),
    ({"tools": TOOLS, "tool_choice": "required", "guided_choice": ["a"]}, ["cannot be combined with guided_choice"]),
    ({"tools": TOOLS, "tool_choice": "required", "use_beam_search": True, "n": 2},
     ['tool_choice "required" is not supported with use_beam_search']),
    ({"tools": TOOLS, "tool_choice": named("get_time"), "use_beam_search": True, "n": 2},
     ["tool_choice naming get_time is not supported with use_beam_search"]),
])
def test_a_tool_choice_we_cannot_follow_is_refused_naming_tool_choice(fields, fragments):
    refused(lambda: chat(**fields), "tool_choice", *fragments)


# ---------------------------------------------------------------- the guide sent to the engine


def test_a_named_choice_guides_by_the_tools_parameters(model):
    body = chat(tools=TOOLS, tool_choice=named("get_time"))
    assert body.tool_choice == ToolChoice("named", "get_time")
    assert guided(body, model) == {"json_schema": TIME_PARAMETERS}
    no_params = chat(tools=[{"type": "function", "function": {"name": "ping"}}], tool_choice=named("ping"))
    assert guided(no_params, model) == {"json_schema": {"type": "object", "properties": {}}}
    assert guided(chat(tools=TOOLS, tool_choice=named("get_weather"), n=3, best_of=4), model) == {
        "json_schema": WEATHER_PARAMETERS}


def test_required_guides_by_an_array_of_calls_to_any_tool(model):
    body = chat(tools=TOOLS, tool_choice="required")
    assert body.tool_choice == ToolChoice("required")
    assert guided(body, model) == {"json_schema": {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": WEATHER_PARAMETERS},
         "required": ["name", "parameters"]},
        {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": TIME_PARAMETERS},
         "required": ["name", "parameters"]},
    ]}}}
    guide = compile_guide(guided(body, model))
    assert complete(guide, '[{"name": "get_time", "parameters": {"zone": "CET"}}, '
                           '{"name":"get_weather","parameters":{"city":"Oslo","unit":"F"}}]')
    assert not complete(guide, '[{"name": "get_time", "parameters": {"city": "Oslo"}}]')  # another tool's
    assert not complete(guide, '[{"name": "get_news", "parameters": {}}]')
    assert not complete(guide, "[]")


def test_required_moves_each_tools_references_to_where_its_parameters_stand():
    place = {"$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
             "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"},
                                               "note": {"const": {"$ref": "#/$defs/Place"}}}, "required": ["to"]}
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}
    tools = chat(tools=[{"type": "function", "function": {"name": "go", "parameters": place}},
                        {"type": "function", "function": {"name": "tree", "parameters": tree}}],
                 tool_choice="required").tools
    schema = required_schema(tools + [TIME])
    assert [option["properties"]["parameters"] for option in schema["items"]["anyOf"]] == [
        {"$ref": "#/$defs/go"}, {"$ref": "#/$defs/tree"}, TIME_PARAMETERS]  # without references: in place
    go, grow = schema["$defs"]["go"], schema["$defs"]["tree"]
    assert go["properties"]["to"] == {"$ref": "#/$defs/go/$defs/Place"}
    assert go["properties"]["note"] == {"const": {"$ref": "#/$defs/Place"}}  # a value, not a reference
    assert grow["properties"]["kids"]["items"] == {"$ref": "#/$defs/tree"}
    assert tools[0]["function"]["parameters"] == place  # the template's copy is the client's
    guide = compile_guide({"json_schema": schema})
    assert complete(guide, '[{"name":"tree","parameters":{"kids":[{"kids":[]}]}},'
                           '{"name":"go","parameters":{"to":{"city":"Rome"}}},'
                           '{"name":"get_time","parameters":{"zone":""}}]')
    assert not complete(guide, '[{"name":"tree","parameters":{"kids":[{"city":"Rome"}]}}]')


# ---------------------------------------------------------------- messages of a tool conversation


CONVERSATION = [
    {"role": "developer", "content": "Use the tools."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "zone=CET"}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_9", "content": [{"type": "text", "text": "?"}]},
    {"role": "assistant", "content": "18 C in Paris.", "tool_calls": []},
    {"role": "user", "content": "Thanks"},
]


def test_a_tool_conversation_reads_as_transformers_templates_take_it():
    assert chat(messages=CONVERSATION).messages == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "zone=CET"}},
        ]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "tool", "content": "?", "tool_call_id": "call_9"},  # no call made it: no name
        {"role": "assistant", "content": "18 C in Paris."},
        {"role": "user", "content": "Thanks"},
    ]
    call = {"id": "c", "function": {"name": "f", "arguments": "[1, 2]"}}
    assistant = chat(messages=[CONVERSATION[1], {"role": "assistant", "tool_calls": [call]}]).messages[1]
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [  # (an array stays text)
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}


@pytest.mark.parametrize("message, param, fragments", [
    ({"role": "tool", "content": "18 C"}, "messages[1].tool_call_id",
     ["messages[1].tool_call_id must be a string (the id of the call this message answers), got nothing"]),
    ({"role": "tool", "content": "18 C", "tool_call_id": 1}, "messages[1].tool_call_id", ["got number"]),
    ({"role": "tool", "tool_call_id": "c"}, "messages[1].content", ["must be a string or a list", "got null"]),
    ({"role": "assistant", "tool_calls": "call"}, "messages[1].tool_calls",
     ["messages[1].tool_calls must be a list of tool calls, got string"]),
    ({"role": "assistant", "tool_calls": ["call"]}, "messages[1].tool_calls",
     ["messages[1].tool_calls[0] must be an object, got string"]),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     "messages[1].tool_calls", ["messages[1].tool_calls[0] needs id (a string)"]),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}, "messages[1].tool_calls",
     ["messages[1].tool_calls[0] needs function (an object)"]),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]}, "messages[1].tool_calls",
     ['messages[1].tool_calls[0].type must be "function", got string "custom"']),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}, "messages[1].tool_calls",
     ["messages[1].tool_calls[0].function.name must be a string, got nothing"]),
    ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]},
     "messages[1].tool_calls", ["messages[1].tool_calls[0].function.arguments must be a string, got object"]),
    ({"role": "function", "name": "f", "content": "x"}, "messages[1].role",
     ["must be one of system, developer, user, assistant, tool, got 'function'"]),
])
def test_malformed_tool_messages_are_refused(message, param, fragments):
    refused(lambda: chat(messages=[CONVERSATION[1], message]), param, *fragments)


SHOW_TOOLS = (  # a template that shows what transformers' tool templates read
    "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments.city if c.function.arguments is mapping else c.function.arguments }}]{% endfor %}"
    "{% if m.tool_call_id is defined %}[for {{ m.tool_call_id }} {{ m.name if m.name is defined else '-' }}]"
    "{% endif %}{% endfor %}"
)


def test_the_chat_template_gets_the_tools_and_the_calls(model):
    tokenizer = copy.deepcopy(model.tokenizer)
    tokenizer.chat_template = SHOW_TOOLS
    shown = ServedModel(model.name, tokenizer, model.max_model_len, model.eos_token_ids)
    for tool_choice in ("none", "required", named("get_time")):
        ids = chat_prompt_ids(chat(messages=CONVERSATION, tools=TOOLS, tool_choice=tool_choice), shown)
        assert tokenizer.decode(ids) == (
            "[tool get_weather][tool get_time]<system>Use the tools.<user>Weather in Paris, and the time?"
            "<assistant>[call call_1 get_weather Paris][call call_2 get_time zone=CET]<tool>18 C[for call_1 "
            "get_weather]<tool>?[for call_9 -]<assistant>18 C in Paris.<user>Thanks")
    assert tokenizer.decode(chat_prompt_ids(chat(messages=CONVERSATION[:2]), shown)) == (
        "<system>Use the tools.<user>Weather in Paris, and the time?")  # no tools: none shown
    smol = chat_prompt_ids(chat(messages=CONVERSATION, tools=TOOLS, tool_choice="none"), model)  # reads content only
    assert "<|im_start|>tool\n18 C<|im_end|>" in model.tokenizer.decode(smol)


def test_required_bounds_its_tools_and_parallel_tool_calls():
    many = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(65)]
    refused(lambda: chat(tools=many, tool_choice="required"), "tool_choice", 'takes at most 64 tools')
    assert chat(tools=many, tool_choice=named("t64")).options.tool_guide is not None  # one tool: any of them
    assert chat(tools=many[:64], tool_choice="required").options.tool_guide is not None
    one = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).options.tool_guide
    guide = compile_guide(one)
    call = '{"name": "get_time", "parameters": {"zone": "CET"}}'
    assert complete(guide, f"[{call}]") and not complete(guide, f"[{call}, {call}]")
    assert complete(compile_guide(chat(tools=TOOLS, tool_choice="required").options.tool_guide), f"[{call}, {call}]")
    refused(lambda: chat(tools=TOOLS, tool_choice="required", parallel_tool_calls="no"), "parallel_tool_calls", "")


def test_required_calls_keep_their_arguments_as_generated():
    from services.frontend.tool_responses import parse_required

    text = ('[ {"name": "a", "parameters": {"x": 1e400, "y": 0.10000000000000000001}} ,\n'
            '{"name":"b","parameters":{"k":1,"k":2}}]')
    assert parse_required(text) == [("a", '{"x": 1e400, "y": 0.10000000000000000001}'), ("b", '{"k":1,"k":2}')]
    assert parse_required('[{"name": "a", "parameters": {}}') is None  # cut short
    assert parse_required('[{"parameters": {}, "name": "a"}]') is None  # not the guide's order: not its output
