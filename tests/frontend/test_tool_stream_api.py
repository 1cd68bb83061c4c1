"""tool_choice "auto" streamed through each parser (hermes, llama3_json, mistral's two formats,
pythonic), served by the frontend against the fake engine told what to say: the openai SDK's own
accumulation (``ChatCompletionStreamState``) of the stream gives the non-streamed response's content,
calls (names and the exact arguments text) and finish reason; a call with a long argument comes in
more than one argument delta (pythonic's at once, when its parenthesis closes) after its name; the
Responses stream's ``function_call_arguments.delta`` events and the Messages stream's
``input_json_delta`` pieces carry the same arguments in pieces, through the official clients."""

from __future__ import annotations

import dataclasses
import json

import anthropic
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from tests.doubles.fake_scheduler import FrontendThread
from tests.frontend.test_tool_calls import TOOLS, TIME_PARAMETERS, say

MAX_MODEL_LEN = 2048  # (the model fixture's)
LONG = "Paris, " * 30 + "東京 🚀"
SAY = {"type": "function", "function": {"name": "say", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "array"}}}}}
# (parser, what the model writes: content, a call with a long argument, a short call)
OUTPUTS = [
    ("hermes", f'Checking both.\n<tool_call>\n{{"name": "say", "arguments": {{"text": "{LONG}", "n": [1, 2.5]}}}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "東京"}}\n</tool_call>'),
    ("llama3_json", f'<|python_tag|>{{"name": "say", "parameters": {{"text": "{LONG}", "n": [1, 2.5]}}}}; '
                    '{"name": "get_time", "parameters": {"zone": "東京"}}'),
    ("mistral", f'Checking both.[TOOL_CALLS][{{"name": "say", "arguments": {{"text": "{LONG}", "n": [1, 2.5]}}}}, '
                '{"name": "get_time", "arguments": {"zone": "東京"}}]'),
    ("mistral", f'Checking both.[TOOL_CALLS]say[ARGS]{{"text": "{LONG}", "n": [1, 2.5]}}'
                '[TOOL_CALLS]get_time[ARGS]{"zone": "東京"}'),
    ("pythonic", f'[say(text="{LONG}", n=[1, 2.5]), get_time(zone="東京")]'),
]
ALL_TOOLS = TOOLS + [SAY]


@pytest.fixture(scope="module")
def servers(model, fake):
    started = {name: FrontendThread(dataclasses.replace(model, tool_parser=name), fake.endpoints).start()
               for name in sorted({name for name, _ in OUTPUTS})}
    yield started
    for server in started.values():
        server.stop()


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)


@pytest.mark.parametrize("parser, text", OUTPUTS)
def test_the_sdk_accumulates_the_stream_to_the_whole_response(servers, model, parser, text):
    client = openai_client(servers[parser])
    fields = {"model": model.name, "messages": say(text), "tools": ALL_TOOLS, "max_tokens": 1000}
    whole = client.chat.completions.create(**fields).choices[0]
    state, argument_deltas, order = ChatCompletionStreamState(), {}, []
    for chunk in client.chat.completions.create(**fields, stream=True):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            order += ["content"] * bool(choice.delta.content)
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    order.append(("name", call.index, call.function.name))
                elif call.function.arguments:
                    argument_deltas[call.index] = argument_deltas.get(call.index, 0) + 1
                    order.append(("arguments", call.index))
    streamed = state.current_completion_snapshot.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [name for name, _ in calls] == ["say", "get_time"] and whole.finish_reason == "tool_calls"
    assert json.loads(calls[0][1]) == {"text": LONG, "n": [1, 2.5]} and json.loads(calls[1][1]) == {"zone": "東京"}
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == calls
    assert (streamed.message.content or None, streamed.finish_reason) == (whole.message.content, "tool_calls")
    assert len({c.id for c in streamed.message.tool_calls}) == 2
    # content, then each call's name before its arguments
    first_call = next(i for i, o in enumerate(order) if o != "content")
    assert "content" not in order[first_call:]
    assert order.index(("name", 0, "say")) < order.index(("arguments", 0)) < order.index(("name", 1, "get_time"))
    assert argument_deltas[0] == 1 if parser == "pythonic" else argument_deltas[0] > 5


def test_the_responses_stream_sends_the_arguments_in_pieces(servers, model):
    client = openai_client(servers["hermes"])
    tools = [{"type": "function", "name": "say", "parameters": SAY["function"]["parameters"]},
             {"type": "function", "name": "get_time", "parameters": TIME_PARAMETERS}]
    text = OUTPUTS[0][1]
    whole = client.responses.create(model=model.name, input=say(text)[0]["content"], tools=tools,
                                   max_output_tokens=1000)
    events = list(client.responses.create(model=model.name, input=say(text)[0]["content"], tools=tools,
                                          max_output_tokens=1000, stream=True))
    final = events[-1].response
    calls = [(i.name, i.arguments) for i in final.output if i.type == "function_call"]
    assert calls == [(i.name, i.arguments) for i in whole.output if i.type == "function_call"] and len(calls) == 2
    for index, (_, arguments) in enumerate(calls):
        output_index = [i for i, item in enumerate(final.output) if item.type == "function_call"][index]
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.output_index == output_index]
        assert "".join(pieces) == arguments and (len(pieces) > 5 or index == 1)


def test_the_messages_stream_sends_input_json_in_pieces(servers, model):
    claude = anthropic.Anthropic(base_url=servers["hermes"].base_url, api_key="unused", max_retries=0, timeout=20)
    tools = [{"name": "say", "input_schema": SAY["function"]["parameters"]},
             {"name": "get_time", "input_schema": TIME_PARAMETERS}]
    fields = {"model": model.name, "max_tokens": 1000, "tools": tools,
              "messages": [{"role": "user", "content": say(OUTPUTS[0][1])[0]["content"]}]}
    whole = claude.messages.create(**fields)
    pieces = []
    with claude.messages.stream(**fields) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                pieces.append((event.index, event.delta.partial_json))
        streamed = stream.get_final_message()
    uses = [(b.name, b.input) for b in streamed.content if b.type == "tool_use"]
    assert uses == [(b.name, b.input) for b in whole.content if b.type == "tool_use"] == [
        ("say", {"text": LONG, "n": [1, 2.5]}), ("get_time", {"zone": "東京"})]
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    first_use = next(i for i, b in enumerate(streamed.content) if b.type == "tool_use")
    assert sum(1 for index, _ in pieces if index == first_use) > 5
