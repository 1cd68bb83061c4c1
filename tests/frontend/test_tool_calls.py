"""Tool calling on /v1/chat/completions, the response side: the responses' shapes, whole and
streamed, through the openai client against the fake engine told what to say; and, through
``pagedserve serve`` on the tiny random model, calls that follow the tools' parameters. The request
side (tools and tool_choice read, guides, tool messages) is ``test_tool_requests.py``."""

from __future__ import annotations

import json

import openai
import pytest

from tests.doubles.http import http, sse_events
from tests.frontend.test_fields import chat, refused
from tests.frontend.test_tool_requests import (  # noqa: F401 (re-exported for the other tool tests)
    AUTO_REASON, CALL_ID, CONVERSATION, TIME_PARAMETERS, TOOLS, WEATHER_PARAMETERS, named, time_conforms,
    weather_conforms,
)


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
