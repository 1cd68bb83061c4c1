"""tool_choice "auto" (``tool_parsers``, ``responses.ChatShapes``): the flags that enable it and pick
its parser (given, or read from the chat template), and its responses through the openai client
against the fake engine told to say what real models write (hermes' tagged calls): calls with
``finish_reason`` "tool_calls", content before them, several calls, ``parallel_tool_calls`` false,
the stream's deltas accumulating to the whole response, and malformed calls as plain content."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from services.frontend.config import FrontendConfig
from services.frontend.flags import add_frontend_arguments
from services.frontend.main import frontend_config_from_args
from services.frontend.served_model import load_served_model
from services.frontend.tool_parsers import auto_tool_parser
from shared.endpoints import Endpoints
from tests.doubles.fake_scheduler import FrontendThread
from tests.doubles.http import http, sse_events
from tests.frontend.test_tool_calls import TOOLS, say

CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TOKYO = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "東京"}}\n</tool_call>'
CALLS = [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "東京"})]


@pytest.fixture(scope="module")
def auto(model, fake):
    server = FrontendThread(dataclasses.replace(model, tool_parser="hermes"), fake.endpoints).start()
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=20), server
    server.stop()


def ask(auto, model, text, **fields):
    client, _ = auto
    return client.chat.completions.create(model=model.name, messages=say(text), tools=TOOLS, **fields)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def accumulated(auto, model, text, **fields):
    """The stream as a client accumulates it: (content or None, calls, finish_reason, raw deltas)."""
    client, _ = auto
    content, calls, finish, deltas = "", {}, None, []
    for chunk in client.chat.completions.create(model=model.name, messages=say(text), tools=TOOLS, stream=True,
                                                **fields):
        for choice in chunk.choices:
            delta = choice.delta
            deltas.append(delta)
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert CALL_ID.fullmatch(call.id) and call.type == "function" and call.function.arguments == ""
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.function.name is None
                    calls[call.index][1] += call.function.arguments
            finish = choice.finish_reason or finish
    return content or None, [(n, json.loads(a)) for n, a in calls.values()], finish, deltas


def sdk_accumulated(auto, model, text, tools=TOOLS, **fields):
    """The stream's choice as the openai SDK accumulates it (``ChatCompletionStreamState``)."""
    client, _ = auto
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(model=model.name, messages=say(text), tools=tools, stream=True,
                                                **fields):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot.choices[0]


@pytest.mark.parametrize("text, content, calls", [
    (PARIS, None, CALLS[:1]),
    (f"Let me look that up.\n\n{PARIS}", "Let me look that up.", CALLS[:1]),
    (f"Both, then.\n{PARIS}\n{TOKYO}\n", "Both, then.", CALLS),
])
def test_auto_calls_whole_and_streamed(auto, fake, model, text, content, calls):
    for fields in ({"tool_choice": "auto"}, {}):  # left out with tools: auto, as in OpenAI's API and vLLM
        choice = ask(auto, model, text, **fields).choices[0]
        assert fake.added[-1].sampling.guided is None  # free output: no guide
        assert (choice.message.content, calls_of(choice.message), choice.finish_reason) == (content, calls,
                                                                                            "tool_calls")
        assert all(CALL_ID.fullmatch(c.id) for c in choice.message.tool_calls)
        assert len({c.id for c in choice.message.tool_calls}) == len(calls)
        streamed_content, streamed_calls, finish, deltas = accumulated(auto, model, text, **fields)
        assert (streamed_content, streamed_calls, finish) == (content, calls, "tool_calls")
        first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
        assert all(not d.content for d in deltas[first_call:])  # content before the calls


def test_parallel_tool_calls_false_keeps_the_first(auto, model):
    text = f"{PARIS}\n{TOKYO}"
    choice = ask(auto, model, text, tool_choice="auto", parallel_tool_calls=False).choices[0]
    assert (calls_of(choice.message), choice.finish_reason) == (CALLS[:1], "tool_calls")
    assert accumulated(auto, model, text, parallel_tool_calls=False)[1:3] == (CALLS[:1], "tool_calls")


@pytest.mark.parametrize("text", [
    "The weather in Paris is mild; no tool needed.",
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # not an object
    '<tool_call>\n{"nom": "get_weather", "arguments": {}}\n</tool_call>',  # not a call
    '<tool_call>\n{"name": "get_weather"',  # never closed
    "a < b and <tool_ but no call",
])
def test_text_and_malformed_calls_are_plain_content(auto, model, text):
    """Whole, and streamed when the output breaks before a call's arguments begin."""
    choice = ask(auto, model, text, tool_choice="auto").choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")
    assert accumulated(auto, model, text)[:3] == (text, [], "stop")


@pytest.mark.parametrize("text, call, rest, finish", [
    # the arguments break after they began: the call stays as sent, the rest from there is content
    ('<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>', ("get_weather", "{"),
     "city: Paris}}\n</tool_call>", "stop"),
    # text after whole calls: content after them, the calls whole (tool_calls)
    (f"{PARIS}\nand then some text after the call", ("get_weather", '{"city": "Paris", "unit": "C"}'),
     "and then some text after the call", "tool_calls"),
])
def test_a_stream_that_breaks_after_a_call_went_out(auto, model, text, call, rest, finish):
    """Whole, plain content; streamed, what was sent stays (``tool_parsers.streaming``)."""
    choice = ask(auto, model, text).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")
    final = sdk_accumulated(auto, model, text)
    got = [(c.function.name, c.function.arguments) for c in final.message.tool_calls]
    assert (got, final.message.content, final.finish_reason) == ([call], rest, finish)


def test_a_call_cut_short_is_content_with_length(auto, model):
    """Whole, content; streamed, the call's arguments as far as they came, finishing "length" (as
    OpenAI's stream cut by max_tokens does), or all content when cut before they began."""
    num_tokens = len(model.tokenizer.encode(PARIS, add_special_tokens=False))
    for max_tokens in (6, num_tokens - 4):
        choice = ask(auto, model, PARIS, max_tokens=max_tokens).choices[0]
        assert choice.finish_reason == "length" and choice.message.tool_calls is None
        assert PARIS.startswith(choice.message.content) and choice.message.content != PARIS
        final = sdk_accumulated(auto, model, PARIS, max_tokens=max_tokens)
        assert final.finish_reason == "length"
        if final.message.tool_calls:
            [call] = final.message.tool_calls
            assert call.function.name == "get_weather" and '"city": "Paris"' in call.function.arguments
            assert call.function.arguments in choice.message.content
            assert choice.message.content.endswith(final.message.content or "")  # what was not sent, if any
        else:
            assert final.message.content == choice.message.content


def test_raw_stream_sends_name_first_then_arguments(auto):
    _, server = auto
    status, _, raw = http("POST", server.base_url + "/v1/chat/completions",
                          body={"messages": say(f"Sure.{TOKYO}"), "tools": TOOLS, "stream": True, "logprobs": True,
                                "stream_options": {"include_usage": True}})
    assert status == 200
    events = [json.loads(e) for e in sse_events(raw)[:-1]]
    usage, events = events[-1]["usage"], events[:-1]
    deltas = [e["choices"][0]["delta"] for e in events]
    header = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
    assert set(header) == {"index", "id", "type", "function"}
    assert header["function"] == {"name": "get_time", "arguments": ""} and header["index"] == 0
    pieces = [d["tool_calls"][0]["function"] for d in deltas[deltas.index({"tool_calls": [header]}) + 1:]
              if "tool_calls" in d]
    assert json.loads("".join(p["arguments"] for p in pieces)) == {"zone": "東京"}
    assert all(set(p) == {"arguments"} for p in pieces)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # every token's logprobs go out, held text's too (as they come, with an empty delta)
    assert sum(len(e["choices"][0]["logprobs"]["content"]) for e in events if e["choices"][0]["logprobs"]) \
        == usage["completion_tokens"] > 0


def test_random_outputs_never_fail(auto):
    _, server = auto
    url = server.base_url + "/v1/chat/completions"
    for text in ["<tool_call>", "<tool_call></tool_call>", '<tool_call>{"name": 1}</tool_call>', "</tool_call>{",
                 '<tool_call>{"name": "x", "arguments": [1]}</tool_call>', "<tool_call>" * 5, "\n\n", "[[", "{"]:
        for stream in (False, True):
            status, _, raw = http("POST", url, body={"messages": say(text), "tools": TOOLS, "stream": stream})
            assert status == 200, (text, raw)


def test_without_the_flag_auto_is_a_400_naming_it(client, model):
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        client.chat.completions.create(model=model.name, messages=say(PARIS), tools=TOOLS, tool_choice="auto")


def test_the_flags_and_the_parser_the_template_shows(tmp_path, tiny_model_dir):
    from services.cli import build_parser
    from services.launcher import frontend_argv

    parser = argparse.ArgumentParser()
    add_frontend_arguments(parser)
    endpoint = ["--request-endpoint", "ipc:///tmp/x.sock"]
    config = frontend_config_from_args(parser.parse_args(endpoint))
    assert (config.enable_auto_tool_choice, config.tool_call_parser) == (False, None)
    config = frontend_config_from_args(parser.parse_args(
        [*endpoint, "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]))
    assert (config.enable_auto_tool_choice, config.tool_call_parser) == (True, "pythonic")
    with pytest.raises(SystemExit):
        parser.parse_args([*endpoint, "--tool-call-parser", "nope"])
    argv = frontend_argv(build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser",
                                                    "mistral"]))
    assert "--enable-auto-tool-choice" in argv and argv[argv.index("--tool-call-parser") + 1] == "mistral"

    assert auto_tool_parser(False, "hermes", "<tool_call>") is None
    assert auto_tool_parser(True, "pythonic", "<tool_call>") == "pythonic"  # the flag wins
    assert auto_tool_parser(True, None, "{{ '[TOOL_CALLS]' }}") == "mistral"
    endpoints = Endpoints.in_directory(str(tmp_path))
    hermes_template = "{% for m in messages %}{{ m.content }}{% endfor %}{# calls: <tool_call>{...}</tool_call> #}"
    loaded = load_served_model(FrontendConfig(model=str(tiny_model_dir), endpoints=endpoints, port=0,
                                              chat_template=hermes_template, enable_auto_tool_choice=True))
    assert loaded.tool_parser == "hermes"
    assert load_served_model(FrontendConfig(model=str(tiny_model_dir), endpoints=endpoints, port=0,
                                            chat_template=hermes_template)).tool_parser is None
    with pytest.raises(ValueError, match=r"^--enable-auto-tool-choice needs --tool-call-parser \(hermes, "):
        load_served_model(FrontendConfig(model=str(tiny_model_dir), endpoints=endpoints, port=0,
                                         chat_template="{{ messages }}", enable_auto_tool_choice=True))


def test_each_choice_parses_its_own_calls(auto, model):
    _, server = auto
    response = ask(auto, model, f"Sure.\n{PARIS}", n=3)
    assert [(c.message.content, calls_of(c.message), c.finish_reason) for c in response.choices] == [
        ("Sure.", CALLS[:1], "tool_calls")] * 3
    assert len({c.message.tool_calls[0].id for c in response.choices}) == 3
    status, _, raw = http("POST", server.base_url + "/v1/chat/completions",
                          body={"messages": say(f"Sure.\n{PARIS}"), "tools": TOOLS, "stream": True, "n": 3})
    assert status == 200
    per_choice: dict[int, dict] = {}
    for event in sse_events(raw)[:-1]:
        for choice in json.loads(event)["choices"]:
            seen = per_choice.setdefault(choice["index"], {"content": "", "arguments": "", "finish": None})
            seen["content"] += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls", []):
                seen["arguments"] += call["function"]["arguments"]
            seen["finish"] = choice["finish_reason"] or seen["finish"]
    assert per_choice == {i: {"content": "Sure.", "arguments": json.dumps(CALLS[0][1]), "finish": "tool_calls"}
                          for i in range(3)}


@pytest.fixture(scope="module")
def thinking_auto(model, fake):
    """Tool choice auto behind the qwen3 reasoning parser: a model that thinks, then calls."""
    served = dataclasses.replace(model, tool_parser="hermes", reasoning_parser="qwen3")
    server = FrontendThread(served, fake.endpoints).start()
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=20), server
    server.stop()


def test_the_reasoning_is_kept_out_of_the_calls_whole_and_streamed(thinking_auto, model):
    """A call written inside the reasoning is thought, not called; the one after it is called."""
    thought = f"Which tool? Perhaps {TOKYO} no, the weather."
    text = f"<think>{thought}</think>\n\n{PARIS}"
    choice = ask(thinking_auto, model, text, tool_choice="auto").choices[0]
    assert choice.message.model_extra["reasoning_content"] == thought
    assert (choice.message.content, calls_of(choice.message), choice.finish_reason) == (None, CALLS[:1],
                                                                                        "tool_calls")
    client, _ = thinking_auto
    reasoning = ""
    for chunk in client.chat.completions.create(model=model.name, messages=say(text), tools=TOOLS, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
    assert reasoning == thought
    assert accumulated(thinking_auto, model, text)[:3] == (None, CALLS[:1], "tool_calls")
