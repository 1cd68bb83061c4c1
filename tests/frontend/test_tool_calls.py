"""Tool calling on /v1/chat/completions (``services/frontend/tools.py``): ``tools`` and ``tool_choice``
read, defaulted and refused with a 400 naming them; the guide a named or "required" choice sends the
engine; a tool conversation's messages as the chat template gets them; the responses' shapes, whole
and streamed, through the openai client against the fake engine told what to say; and, through
``pagedserve serve`` on the tiny random model, calls that follow the tools' parameters."""

from __future__ import annotations

import copy
import json
import re

import openai
import pytest

from services.frontend.preprocess import chat_prompt_ids
from services.frontend.served_model import ServedModel
from services.frontend.tools import NO_PARAMETERS, ToolChoice, required_schema
from shared.structured import compile_guide
from tests.doubles.http import http, sse_events
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


# ---------------------------------------------------------------- responses, against the fake engine


def say(text: str) -> list[dict]:
    """Messages the fake engine answers with ``text`` (``SAY_PATTERN``), in every choice."""
    return [{"role": "user", "content": f"[[say]]{text}[[/say]]"}]


WEATHER_ARGS = '{"city": "Paris", "unit": "C"}'
CALLS = [{"name": "get_weather", "parameters": {"city": "Paris"}},
         {"name": "get_time", "parameters": {"zone": "東京"}}]
CALLS_TEXT = json.dumps(CALLS, ensure_ascii=False)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls]


def test_a_named_call(client, fake, model):
    response = client.chat.completions.create(model=model.name, messages=say(WEATHER_ARGS), tools=TOOLS,
                                              tool_choice=named("get_weather"), n=2)
    assert json.loads(fake.added[-1].sampling.guided) == {"json_schema": WEATHER_PARAMETERS}
    ids = set()
    for choice in response.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None and choice.message.role == "assistant"
        [call] = choice.message.tool_calls
        assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", WEATHER_ARGS)
        assert CALL_ID.fullmatch(call.id)
        ids.add(call.id)
    assert len(ids) == 2
    cut = client.chat.completions.create(model=model.name, messages=say(WEATHER_ARGS), tools=TOOLS,
                                         tool_choice=named("get_weather"), max_tokens=3).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None  # incomplete arguments, as in vLLM
    arguments = cut.message.tool_calls[0].function.arguments
    assert arguments and WEATHER_ARGS.startswith(arguments) and arguments != WEATHER_ARGS


def test_required_calls(client, fake, model):
    response = client.chat.completions.create(model=model.name, messages=say(CALLS_TEXT), tools=TOOLS,
                                              tool_choice="required", n=2)
    assert json.loads(fake.added[-1].sampling.guided)["json_schema"]["minItems"] == 1
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert calls_of(choice.message) == [(c["name"], c["parameters"]) for c in CALLS]
        assert choice.message.tool_calls[1].function.arguments == '{"zone": "東京"}'  # json.dumps, not ASCII
    assert len({c.id for choice in response.choices for c in choice.message.tool_calls}) == 4
    # cut short by max_tokens: not an array of calls, so text, and the engine's reason
    choice = client.chat.completions.create(model=model.name, messages=say(CALLS_TEXT), tools=TOOLS,
                                            tool_choice="required", max_tokens=5).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert CALLS_TEXT.startswith(choice.message.content) and choice.message.content
    # a stop string would cut a call and leave it looking finished: refused
    with pytest.raises(openai.BadRequestError, match="stop is not supported with tool_choice"):
        client.chat.completions.create(model=model.name, messages=say(CALLS_TEXT), tools=TOOLS,
                                       tool_choice="required", stop=["get_time"])
    refused(lambda: chat(tools=TOOLS, tool_choice=named("get_time"), stop="x"), "stop", "would cut the call")
    assert chat(tools=TOOLS, tool_choice="none", stop="x").options.stop == ["x"]  # text: as ever


def test_the_raw_bodies_have_null_content(frontend):
    url = frontend.base_url + "/v1/chat/completions"
    status, _, raw = http("POST", url, body={"messages": say(WEATHER_ARGS), "tools": TOOLS,
                                             "tool_choice": named("get_weather")})
    message = json.loads(raw)["choices"][0]["message"]
    assert status == 200 and message["content"] is None and set(message) == {"role", "content", "tool_calls"}
    status, _, raw = http("POST", url, body={"messages": say("Hi"), "tools": TOOLS, "tool_choice": "none"})
    assert status == 200 and json.loads(raw)["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}


def stream_events(frontend, **body) -> list[dict]:
    status, _, raw = http("POST", frontend.base_url + "/v1/chat/completions", body=body | {"stream": True})
    assert status == 200, raw
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_a_named_call_streams_its_header_then_its_arguments(frontend, client, model):
    events = stream_events(frontend, messages=say(WEATHER_ARGS), tools=TOOLS, tool_choice=named("get_weather"))
    deltas = [e["choices"][0]["delta"] for e in events]
    [header] = deltas[0]["tool_calls"]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"] is None and CALL_ID.fullmatch(header.pop("id"))
    assert header == {"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    pieces = [d["tool_calls"] for d in deltas[1:] if d]
    assert all(len(p) == 1 and set(p[0]) == {"index", "function"} and set(p[0]["function"]) == {"arguments"}
               for p in pieces) and len(pieces) > 1
    assert "".join(p[0]["function"]["arguments"] for p in pieces) == WEATHER_ARGS
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "stop"
    with client.chat.completions.stream(model=model.name, messages=say(WEATHER_ARGS), tools=TOOLS,
                                        tool_choice=named("get_weather"), n=2) as stream:
        final = stream.get_final_completion()
    assert [c.finish_reason for c in final.choices] == ["stop", "stop"]
    for choice in final.choices:
        [call] = choice.message.tool_calls
        assert (call.function.name, call.function.arguments, choice.message.content) == ("get_weather", WEATHER_ARGS,
                                                                                          None)
    assert final.choices[0].message.tool_calls[0].id != final.choices[1].message.tool_calls[0].id


def test_required_calls_stream_name_first_then_arguments_in_pieces(frontend, client, model):
    events = stream_events(frontend, messages=say(CALLS_TEXT), tools=TOOLS, tool_choice="required", logprobs=True)
    choices = [e["choices"][0] for e in events]
    assert choices[0]["delta"] == {"role": "assistant", "content": None}
    assert (choices[-1]["delta"], choices[-1]["finish_reason"]) == ({}, "tool_calls")
    deltas = [d for c in choices[1:-1] for d in c["delta"].get("tool_calls", [])]
    assert all("content" not in c["delta"] or not c["delta"]["content"] for c in choices[1:])
    heads = [d for d in deltas if "id" in d]
    assert [h["index"] for h in heads] == [0, 1] and all(CALL_ID.fullmatch(h["id"]) and h["type"] == "function"
                                                          for h in heads)
    assert [(h["function"]["name"], h["function"]["arguments"]) for h in heads] == [(c["name"], "") for c in CALLS]
    pieces = {i: [d["function"]["arguments"] for d in deltas if d["index"] == i and "id" not in d] for i in (0, 1)}
    assert [json.loads("".join(pieces[i])) for i in (0, 1)] == [c["parameters"] for c in CALLS]
    assert max(len(p) for p in pieces.values()) > 1  # in pieces, not whole
    assert sum(len(c["logprobs"]["content"]) for c in choices if c.get("logprobs")) > 1
    with client.chat.completions.stream(model=model.name, messages=say(CALLS_TEXT), tools=TOOLS,
                                        tool_choice="required", n=2) as stream:
        final = stream.get_final_completion()
    for choice in final.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert calls_of(choice.message) == [(c["name"], c["parameters"]) for c in CALLS]
    cut = stream_events(frontend, messages=say(CALLS_TEXT), tools=TOOLS, tool_choice="required", max_tokens=5)
    # cut before a call's name is whole: nothing was sent as a call, the text comes as content
    assert [c["choices"][0]["finish_reason"] for c in cut][-1] == "length"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in cut)
    assert text and CALLS_TEXT.startswith(text) and not any("tool_calls" in c["choices"][0]["delta"] for c in cut)


def test_refusals_over_http_name_the_field(frontend, fake):
    url = frontend.base_url + "/v1/chat/completions"
    num_added = len(fake.added)
    for body, param, fragment in (
        ({"tools": TOOLS}, "tool_choice", AUTO_REASON),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"format": "stardate"}}}],
          "tool_choice": "required"}, "tools", "tools[0].function.parameters: "),
        ({"tools": TOOLS, "tool_choice": named("nope"), "stream": True}, "tool_choice", "not among the tools"),
    ):
        status, _, raw = http("POST", url, body={"messages": say("x")} | body)
        error = json.loads(raw)["error"]
        assert (status, error["param"], error["type"]) == (400, param, "invalid_request_error"), error
        assert fragment in error["message"]
    assert len(fake.added) == num_added


def test_openapi_describes_tools_tool_choice_and_tool_messages(frontend):
    status, _, raw = http("GET", frontend.base_url + "/openapi.json")
    schemas = json.loads(raw)["components"]["schemas"]
    chat_request = schemas["ChatCompletionRequest"]["properties"]
    assert chat_request["tools"]["maxItems"] == 128
    function = chat_request["tools"]["items"]["properties"]["function"]
    assert function["required"] == ["name"] and function["properties"]["name"]["pattern"] == "^[a-zA-Z0-9_-]{1,64}$"
    assert chat_request["tool_choice"]["oneOf"][0] == {"enum": ["none", "auto", "required"]}
    assert "tool-call parser" in chat_request["tool_choice"]["description"]
    assert not {"tools", "tool_choice"} & set(schemas["CompletionRequest"]["properties"])
    roles = [option["properties"]["role"] for option in schemas["ChatMessage"]["oneOf"]]
    assert roles == [{"enum": ["system", "developer", "user"]}, {"const": "assistant"}, {"const": "tool"}]
    assistant, tool = schemas["ChatMessage"]["oneOf"][1:]
    assert assistant["required"] == ["role"] and "tool_calls" in assistant["properties"]
    assert tool["required"] == ["role", "content", "tool_call_id"]


# ---------------------------------------------------------------- the tiny model through pagedserve serve


QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def tiny(tiny_f32_server):
    url, _ = tiny_f32_server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
def test_a_named_call_on_the_tiny_model_streams_as_it_answers(tiny):
    response = tiny.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, temperature=0,
                                            tool_choice=named("get_weather"), max_tokens=120)
    choice = response.choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.message.content is None
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "stop":
        assert weather_conforms(json.loads(call.function.arguments)), call.function.arguments
    with tiny.chat.completions.stream(model="tiny", messages=QUESTION, tools=TOOLS, temperature=0,
                                      tool_choice=named("get_weather"), max_tokens=120) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.message.tool_calls[0].function.arguments == call.function.arguments
    assert streamed.finish_reason == choice.finish_reason


@pytest.mark.slow
def test_required_calls_on_the_tiny_model_name_the_tools(tiny):
    response = tiny.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=3, n=3, max_tokens=120)
    for choice in response.choices:
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None and choice.message.tool_calls
            for name, arguments in calls_of(choice.message):
                assert {"get_weather": weather_conforms, "get_time": time_conforms}[name](arguments), arguments
        else:
            assert choice.finish_reason == "length" and choice.message.tool_calls is None
            assert choice.message.content.lstrip().startswith("[")


@pytest.mark.slow
def test_a_tool_conversation_is_answered_by_the_tiny_model(tiny):
    for fields in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        choice = tiny.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=8, **fields).choices[0]
        assert isinstance(choice.message.content, str) and choice.message.tool_calls is None
    # tools without tool_choice: "auto" (the server has --enable-auto-tool-choice): the tiny model's
    # text is no hermes call, so it is content
    choice = tiny.chat.completions.create(model="tiny", messages=CONVERSATION, tools=TOOLS, max_tokens=8).choices[0]
    assert isinstance(choice.message.content, str) and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")


HERMES_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


@pytest.mark.slow
def test_auto_calls_through_serve_parse_what_the_model_writes(tiny):
    """The tiny model cannot choose a tool: guided_choice makes it write a hermes call, word for
    word, and "auto" reads the call from its text, whole and streamed."""
    fields = {"model": "tiny", "messages": QUESTION, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 60,
              "extra_body": {"guided_choice": [f"Checking.\n{HERMES_CALL}"]}}
    choice = tiny.chat.completions.create(**fields).choices[0]
    assert (choice.message.content, calls_of(choice.message), choice.finish_reason) == (
        "Checking.", [("get_time", {"zone": "UTC"})], "tool_calls")
    with tiny.chat.completions.stream(**fields) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert (streamed.message.content, calls_of(streamed.message), streamed.finish_reason) == (
        "Checking.", [("get_time", {"zone": "UTC"})], "tool_calls")


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
