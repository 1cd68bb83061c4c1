"""The Responses API (``/v1/responses``, ``services/frontend/responses_api.py``) through the
official openai client against the fake engine told what to say (``[[say]]...[[/say]]``): text
and message-list input with instructions, a stream whose deltas join to the final text with its
events in the documented order, ``max_output_tokens`` making it incomplete, function tools
(named and, with hermes' parser, "auto") as ``function_call`` items, a follow-up with the tool's
output through ``previous_response_id``, stored responses fetched, cancelled, deleted, unknown
ids as 404 and bad fields as 400 naming them."""

from __future__ import annotations

import dataclasses
import json

import openai
import pytest

from tests.doubles.fake_scheduler import FrontendThread
from tests.doubles.http import http
from tests.frontend.test_tool_auto import PARIS
from tests.frontend.test_tool_calls import WEATHER_PARAMETERS

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": WEATHER_PARAMETERS}


def say(text: str) -> str:
    return f"[[say]]{text}[[/say]]"


def prompt_of(fake, model) -> str:
    return model.tokenizer.decode(fake.added[-1].prompt_token_ids)


def test_text_input(client, fake, model):
    response = client.responses.create(model=model.name, input=say("Hello there, 東京 🚀!"))
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == "Hello there, 東京 🚀!"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    usage = response.usage
    assert usage.input_tokens == len(fake.added[-1].prompt_token_ids) and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_messages_with_instructions(client, fake, model):
    response = client.responses.create(
        model=model.name, instructions="Be brief.", temperature=0.5, top_p=0.9, max_output_tokens=50,
        input=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "output_text",
                                                                                     "text": "Hello!"}]},
               {"role": "user", "content": [{"type": "input_text", "text": say("Fine.")}]}])
    assert response.output_text == "Fine." and response.instructions == "Be brief."
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.5, 0.9, 50)
    sampling = fake.added[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (0.5, 0.9, 50)
    prompt = prompt_of(fake, model)
    assert prompt.index("Be brief.") < prompt.index("Hi") < prompt.index("Hello!") < prompt.index("[[say]]")


ORDER = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]


def test_stream_events_in_order_and_deltas_join(client, model):
    text = "One, two, three, four, five: 東京 🚀."
    events = list(client.responses.create(model=model.name, input=say(text), stream=True))
    types = [e.type for e in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas > 1 and types == ORDER + ["response.output_text.delta"] * num_deltas + TAIL
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text and final.usage.output_tokens > 0
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))
    assert client.responses.retrieve(final.id).output_text == text


def test_max_output_tokens_makes_it_incomplete(client, model):
    response = client.responses.create(model=model.name, input=say("a long answer that goes on and on"),
                                       max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2
    events = list(client.responses.create(model=model.name, input=say("a long answer that goes on and on"),
                                          max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_named_function_then_its_output_through_previous_response_id(client, fake, model):
    first = client.responses.create(model=model.name, input=say('{"city": "Paris"}'), tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"})
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.status == "completed"
    assert first.tool_choice.name == "get_weather" and first.tools[0].name == "get_weather"
    follow = client.responses.create(
        model=model.name, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 C and sunny"},
               {"role": "user", "content": "And tomorrow?"}])
    assert follow.status == "completed" and follow.previous_response_id == first.id
    prompt = prompt_of(fake, model)  # the first request's input, then the tool's output, then the new input
    assert prompt.index('{"city": "Paris"}') < prompt.index("22 C and sunny") < prompt.index("And tomorrow?")


@pytest.fixture(scope="module")
def auto(model, fake):
    server = FrontendThread(dataclasses.replace(model, tool_parser="hermes"), fake.endpoints).start()
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)
    server.stop()


def test_auto_calls_whole_and_streamed(auto, model):
    text = f"Let me look.\n{PARIS}"
    whole = auto.responses.create(model=model.name, input=say(text), tools=[WEATHER])
    assert [item.type for item in whole.output] == ["message", "function_call"]
    assert whole.output_text == "Let me look." and json.loads(whole.output[1].arguments)["city"] == "Paris"
    events = list(auto.responses.create(model=model.name, input=say(text), tools=[WEATHER], stream=True))
    types = [e.type for e in events]
    added = len(types) - 1 - types[::-1].index("response.output_item.added")
    assert types[added + 1:] == ["response.function_call_arguments.delta"] * (len(types) - added - 4) + [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    call = events[-1].response.output[-1]
    assert call.type == "function_call" and call.arguments == whole.output[1].arguments
    assert "".join(e.delta for e in events[added + 1:-3]) == call.arguments  # in pieces, as they come
    assert events[-3].arguments == call.arguments and events[-2].item.call_id == call.call_id


def test_retrieve_cancel_delete_and_unknown_ids(client, frontend, model):
    response = client.responses.create(model=model.name, input=say("Kept."))
    assert client.responses.retrieve(response.id).output_text == "Kept."
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(response.id)
    client.responses.delete(response.id)
    for call in (lambda: client.responses.retrieve(response.id), lambda: client.responses.cancel("resp_nope"),
                 lambda: client.responses.create(model=model.name, input="x", previous_response_id="resp_nope")):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["code"] == "response_not_found"
    unstored = client.responses.create(model=model.name, input=say("Not kept."), store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("fields, param", [
    ({"input": 7}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"background": True}, "background"),
    ({"temperature": "hot"}, "temperature"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_bad_fields_are_400s_naming_them(frontend, model, fields, param):
    status, _, raw = http("POST", frontend.base_url + "/v1/responses", body={"model": model.name, "input": "hi"} | fields)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param, error
    status, _, _ = http("GET", frontend.base_url + "/health")
    assert status == 200


def test_reasoning_item_with_a_reasoning_parser(model, fake):
    server = FrontendThread(dataclasses.replace(model, reasoning_parser="deepseek_r1"), fake.endpoints).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)
        text = say("Two and two make four.</think>It is 4.")
        whole = client.responses.create(model=model.name, input=text)
        assert [item.type for item in whole.output] == ["reasoning", "message"]
        assert whole.output[0].content[0].text == "Two and two make four." and whole.output_text == "It is 4."
        events = list(client.responses.create(model=model.name, input=text, stream=True))
        reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert reasoning == "Two and two make four." and events[-1].response.output_text == "It is 4."
        assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
    finally:
        server.stop()
