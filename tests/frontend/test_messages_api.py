"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens: ``anthropic_routes``) through
the official ``anthropic`` client against the fake engine: system prompts and content blocks, the
streamed events (both the ``messages.stream`` helper and ``create(stream=True)``) equal to the whole
reply, the stop reasons, a named tool's ``tool_use`` block and a ``tool_result`` follow-up, the
token count equal to the chat template's, ``x-api-key``, and errors in Anthropic's shape."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import pytest

from services.frontend.preprocess import chat_prompt_ids
from services.frontend.request_body import parse_chat_body
from tests.doubles.fake_scheduler import REPLY_TEXT, FrontendThread
from tests.doubles.http import http
from tests.frontend.test_tool_calls import WEATHER_ARGS, WEATHER_PARAMETERS

API_KEY = "sk-messages-test"
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_PARAMETERS}]
EVENT_ORDER = ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
               "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def server(model, fake):
    thread = FrontendThread(model, fake.endpoints, api_key=API_KEY).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=20)


def say(text: str) -> str:
    return f"[[say]]{text}[[/say]]"


def test_a_message_with_a_system_prompt(claude, fake, model):
    reply = claude.messages.create(model=model.name, max_tokens=200, system="Be brief.",
                                   messages=[{"role": "user", "content": "Hi"}])
    assert reply.type == "message" and reply.role == "assistant" and reply.model == model.name
    assert reply.id.startswith("msg_") and reply.stop_reason == "end_turn" and reply.stop_sequence is None
    [block] = reply.content
    assert block.type == "text" and block.text == REPLY_TEXT
    prompt = model.tokenizer.decode(fake.added[-1].prompt_token_ids)
    assert "Be brief." in prompt and "Hi" in prompt
    assert reply.usage.input_tokens == len(fake.added[-1].prompt_token_ids)
    assert reply.usage.output_tokens == len(fake.reply_token_ids) + 1  # and the EOS


def test_content_blocks(claude, fake, model):
    reply = claude.messages.create(
        model=model.name, max_tokens=50, system=[{"type": "text", "text": "Sys one."}, {"type": "text", "text": "Two."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "an answer"}]},
                  {"role": "user", "content": [{"type": "text", "text": say("blocks ok")}]}],
        metadata={"user_id": "someone"},
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20})  # (this client version sends none of these)
    assert reply.content[0].text == "blocks ok"
    prompt = model.tokenizer.decode(fake.added[-1].prompt_token_ids)
    assert all(part in prompt for part in ("Sys one.\nTwo.", "first\nsecond", "an answer"))
    sampling = fake.added[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.9, 20)


def _raw_events(claude, model, **fields):
    return list(claude.messages.create(model=model.name, stream=True, **fields))


def test_stream_equals_the_whole_reply(claude, model):
    fields = {"max_tokens": 200, "messages": [{"role": "user", "content": "Hi"}]}
    whole = claude.messages.create(model=model.name, **fields)
    with claude.messages.stream(model=model.name, **fields) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == REPLY_TEXT
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    events = _raw_events(claude, model, **fields)
    kinds = [e.type for e in events]
    assert [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]] == EVENT_ORDER
    assert events[0].message.content == [] and events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == REPLY_TEXT
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == whole.usage.output_tokens


def test_max_tokens_and_stop_sequences(claude, model):
    cut = claude.messages.create(model=model.name, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    for stream in (False, True):
        fields = {"max_tokens": 200, "messages": [{"role": "user", "content": "Hi"}],
                  "stop_sequences": ["nowhere", "STOP"]}
        if stream:
            with claude.messages.stream(model=model.name, **fields) as s:
                reply = s.get_final_message()
        else:
            reply = claude.messages.create(model=model.name, **fields)
        assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "STOP"
        assert reply.content[0].text == REPLY_TEXT[:REPLY_TEXT.index("STOP")]


def test_a_named_tool_then_its_result(claude, fake, model):
    fields = {"max_tokens": 100, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"},
              "messages": [{"role": "user", "content": say(WEATHER_ARGS)}]}
    reply = claude.messages.create(model=model.name, **fields)
    assert json.loads(fake.added[-1].sampling.guided) == {"json_schema": WEATHER_PARAMETERS}
    [call] = reply.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == json.loads(WEATHER_ARGS)
    assert call.id.startswith("toolu_") and reply.stop_reason == "tool_use"
    with claude.messages.stream(model=model.name, **fields) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].input == call.input and streamed.stop_reason == "tool_use"
    follow_up = claude.messages.create(model=model.name, max_tokens=50, tools=TOOLS, messages=[
        {"role": "user", "content": "The weather in Paris?"},  # (the fake says the prompt's first [[say]])
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, call.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees"},
                                     {"type": "text", "text": say("It is 18.")}]}])
    assert follow_up.content[0].text == "It is 18." and follow_up.stop_reason == "end_turn"
    prompt = model.tokenizer.decode(fake.added[-1].prompt_token_ids)
    assert "18 degrees" in prompt and prompt.index("18 degrees") < prompt.index("It is 18.")


def test_count_tokens_is_the_chat_templates(claude, model):
    fields = {"system": "Be brief.", "messages": [{"role": "user", "content": "How many tokens?"}], "tools": TOOLS}
    counted = claude.messages.count_tokens(model=model.name, **fields)
    chat_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                    "parameters": t["input_schema"]}} for t in TOOLS]
    chat = parse_chat_body({"messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "How many tokens?"}],
                            "tools": chat_tools, "tool_choice": "none"}, model.name)
    assert counted.input_tokens == len(chat_prompt_ids(chat, model)) > 0
    longer = claude.messages.count_tokens(model=model.name, **fields | {"system": "Be brief. Be kind."})
    assert longer.input_tokens > counted.input_tokens


def test_api_key_as_x_api_key(server, model):
    """The client as installed (2.17) sends its key as Authorization: Bearer; x-api-key (what other versions
    and Claude Code send) is tested with raw requests."""
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0, timeout=20)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=model.name, max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.status_code == 401 and caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "authentication_error"
    status, _, raw = http("POST", server.base_url + "/v1/messages", body={"max_tokens": 5, "messages": []})
    assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
    body = {"model": model.name, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
    for key, expected in ((API_KEY, 200), ("wrong", 401)):  # the header Anthropic's clients send
        status, reply = _post(server.base_url + "/v1/messages", body, {"x-api-key": key,
                                                                       "anthropic-version": "2023-06-01"})
        assert status == expected
        assert reply["usage"]["output_tokens"] == 3 if status == 200 else reply["error"]["type"] == "authentication_error"
    assert _post(server.base_url + "/v1/chat/completions", {"messages": []}, {"x-api-key": API_KEY})[0] == 401


def _post(url: str, body: dict, headers: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("fields, fragment", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens is required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "image content blocks are not supported"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "Hi"}]}, 'role "user" or "assistant"'),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "any"}},
     "needs tools"),
])
def test_bad_requests_in_anthropics_shape(claude, model, fields, fragment):
    with pytest.raises(anthropic.BadRequestError) as caught:  # (sent as it is: the client checks max_tokens)
        claude.post("/v1/messages", body={"model": model.name, **fields}, cast_to=object)
    body = caught.value.body
    assert caught.value.status_code == 400 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and fragment in body["error"]["message"]
    assert claude.messages.create(model=model.name, max_tokens=4,  # still serving
                                  messages=[{"role": "user", "content": "Hi"}]).usage.output_tokens == 4


def test_openai_routes_keep_their_error_shape(server):
    status, _, raw = http("POST", server.base_url + "/v1/chat/completions", body={"messages": []})
    assert status == 401 and "type" in json.loads(raw)["error"] and "code" in json.loads(raw)["error"]


def test_openapi_lists_the_routes(claude):
    spec = claude.get("/openapi.json", cast_to=object)
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= set(spec["paths"])


def test_engine_errors_in_anthropics_shape(claude, model):
    fields = {"model": model.name, "max_tokens": 20, "messages": [{"role": "user", "content": "[[error]]"}]}
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude.messages.create(**fields)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError) as caught:  # streamed: an error event after message_start
        list(claude.messages.create(stream=True, **fields))
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "api_error"
