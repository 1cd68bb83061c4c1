"""``--reasoning-parser`` and ``chat_template_kwargs`` on /v1/chat/completions, through the openai
client against the fake engine told what to say (``[[say]]...[[/say]]``): ``reasoning_content``
apart from ``content``, whole and streamed (the stream's pieces joined equal the whole answer),
each choice on its own; outputs without tags as each parser reads them; the completions route
and guided requests untouched; the template's variables reaching it, and refused with a 400."""

from __future__ import annotations

import copy
import dataclasses
import json

import openai
import pytest

from services.frontend.reasoning import reasoning_for
from tests.doubles.fake_scheduler import FrontendThread
from tests.doubles.http import http
from tests.frontend.test_fields import chat, refused
from tests.frontend.test_tool_calls import say

THOUGHT = "The user asks for 2+2. 東京 🚀 is not relevant; 2+2 is 4.\n"
ANSWER = "\n\n2 + 2 = 4."
R1_OUTPUT = f"{THOUGHT}</think>{ANSWER}"
QWEN3_OUTPUT = f"<think>\n{THOUGHT}</think>{ANSWER}"


@pytest.fixture(scope="module")
def model(model):
    return dataclasses.replace(model, reasoning_parser="deepseek_r1")


@pytest.fixture(scope="module")
def qwen3(model, fake):
    """A second frontend on the same fake engine, with --reasoning-parser qwen3 and a template that
    shows its variable, Qwen3's way: enable_thinking false closes an empty block in the prompt, and
    think_in_prompt opens one there (as the Thinking-2507 templates do)."""
    tokenizer = copy.deepcopy(model.tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}[{{ note | default('no note') }}]"
        "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% elif think_in_prompt is defined %}<think>\n{% endif %}{% endif %}")
    served = dataclasses.replace(model, tokenizer=tokenizer, reasoning_parser="qwen3")
    server = FrontendThread(served, fake.endpoints).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def qwen3_client(qwen3):
    return openai.OpenAI(base_url=qwen3.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)


def reasoning_of(message_or_delta) -> str | None:
    return (message_or_delta.model_extra or {}).get("reasoning_content")


def streamed(client, model_name: str, **request) -> dict[int, tuple[str | None, str | None, str | None]]:
    """Each choice's (reasoning, content, finish_reason), its deltas joined."""
    parts: dict[int, list] = {}
    stream = client.chat.completions.create(model=model_name, stream=True, **request)
    for chunk in stream:
        for choice in chunk.choices:
            got = parts.setdefault(choice.index, ["", "", None])
            delta = choice.delta
            assert not (reasoning_of(delta) and delta.content), "a chunk carries one of the two"
            got[0] += reasoning_of(delta) or ""
            got[1] += delta.content or ""
            got[2] = choice.finish_reason or got[2]
    return {i: (r or None, c or None, f) for i, (r, c, f) in parts.items()}


def whole(client, model_name: str, **request) -> dict[int, tuple[str | None, str | None, str | None]]:
    response = client.chat.completions.create(model=model_name, **request)
    return {c.index: (reasoning_of(c.message), c.message.content, c.finish_reason) for c in response.choices}


@pytest.mark.parametrize("output, parts", [
    (R1_OUTPUT, (THOUGHT, ANSWER)),
    (f"<think>{R1_OUTPUT}", (THOUGHT, ANSWER)),  # R1-0528 repeats the tag the prompt opened
    (THOUGHT, (THOUGHT, None)),  # no </think>: all reasoning
    (f"</think>{ANSWER}", (None, ANSWER)),
])
def test_deepseek_r1_whole_and_streamed(client, model, output, parts):
    expected = {i: (*parts, "stop") for i in range(2)}
    assert whole(client, model.name, messages=say(output), n=2) == expected
    assert streamed(client, model.name, messages=say(output), n=2) == expected


def test_beam_search_hypotheses_are_split(client, model):
    request = {"messages": say(R1_OUTPUT), "n": 2, "extra_body": {"use_beam_search": True}}
    expected = {i: (THOUGHT, ANSWER, "stop") for i in range(2)}
    assert whole(client, model.name, **request) == expected == streamed(client, model.name, **request)


def test_the_raw_message_and_chunks(frontend):
    url = frontend.base_url + "/v1/chat/completions"
    status, _, raw = http("POST", url, body={"messages": say(R1_OUTPUT)})
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["message"] == {"role": "assistant", "content": ANSWER,
                                                       "reasoning_content": THOUGHT}
    status, _, raw = http("POST", url, body={"messages": say(THOUGHT)})
    assert json.loads(raw)["choices"][0]["message"] == {"role": "assistant", "content": None,
                                                       "reasoning_content": THOUGHT}


def test_a_cut_answer_and_logprobs_stream_as_the_whole(client, model):
    for max_tokens in (3, 10, 20, 30):
        cut = whole(client, model.name, messages=say(R1_OUTPUT), max_tokens=max_tokens)
        assert cut == streamed(client, model.name, messages=say(R1_OUTPUT), max_tokens=max_tokens), max_tokens
        assert cut[0][2] == "length"
    num_tokens = 0
    for chunk in client.chat.completions.create(model=model.name, messages=say(R1_OUTPUT), stream=True,
                                                logprobs=True):
        for choice in chunk.choices:
            num_tokens += len(choice.logprobs.content) if choice.logprobs else 0
    response = client.chat.completions.create(model=model.name, messages=say(R1_OUTPUT), logprobs=True)
    assert num_tokens == len(response.choices[0].logprobs.content) == response.usage.completion_tokens


def test_guided_requests_and_completions_are_not_split(client, model):
    response = client.chat.completions.create(model=model.name, messages=say('{"a": 1}'),
                                              response_format={"type": "json_object"})
    assert response.choices[0].message.content == '{"a": 1}' and reasoning_of(response.choices[0].message) is None
    completion = client.completions.create(model=model.name, prompt=f"[[say]]{R1_OUTPUT}[[/say]]", max_tokens=100)
    assert completion.choices[0].text == R1_OUTPUT and reasoning_of(completion.choices[0]) is None


def test_qwen3_whole_and_streamed(qwen3_client, model):
    for output, parts in (
        (QWEN3_OUTPUT, ("\n" + THOUGHT, ANSWER)),
        (ANSWER, (None, ANSWER)),  # no block (enable_thinking false): all content
        (R1_OUTPUT, (None, R1_OUTPUT)),  # nor without the opening tag
        (f"<think>{THOUGHT}", (THOUGHT, None)),  # opened, cut short: reasoning
    ):
        expected = {i: (*parts, "stop") for i in range(2)}
        assert whole(qwen3_client, model.name, messages=say(output), n=2) == expected, output
        assert streamed(qwen3_client, model.name, messages=say(output), n=2) == expected, output


def test_chat_template_kwargs_reach_the_template(qwen3, qwen3_client, model):
    """The template's [note] shows the variable; the fake says what the prompt's [[say]] holds, so
    a note that closes a say makes the engine say it."""
    url = qwen3.base_url + "/tokenize"
    messages = [{"role": "user", "content": "Hi"}]
    for kwargs, shown in ((None, "[no note]"), ({"note": "hello 東京"}, "[hello 東京]")):
        status, _, raw = http("POST", url, body={"messages": messages} | ({"chat_template_kwargs": kwargs}
                                                                          if kwargs else {}))
        assert status == 200, raw
        assert shown in model.tokenizer.decode(json.loads(raw)["tokens"])
    said = [{"role": "user", "content": "[[say]]"}]
    response = qwen3_client.chat.completions.create(
        model=model.name, messages=said, extra_body={"chat_template_kwargs": {"note": "from the kwargs[[/say]]"}})
    assert response.choices[0].message.content == "[from the kwargs"  # the template's bracket, then the note


def test_enable_thinking_false_closes_the_block_in_the_prompt(qwen3_client, model):
    """A prompt that ends inside <think> (the Thinking-2507 templates) starts the output in the
    reasoning; with the block closed there, the same output is all content."""
    thinking_prompt = [{"role": "user", "content": f"[[say]]{R1_OUTPUT}[[/say]]"}]
    assert reasoning_for("qwen3", "<assistant><think>\n").starts_inside
    for kwargs, parts in (({"enable_thinking": False}, (None, R1_OUTPUT)),
                          ({"enable_thinking": True}, (None, R1_OUTPUT)),
                          ({"think_in_prompt": True}, (THOUGHT, ANSWER))):
        request = {"messages": thinking_prompt, "extra_body": {"chat_template_kwargs": kwargs}, "n": 2}
        expected = {i: (*parts, "stop") for i in range(2)}
        assert whole(qwen3_client, model.name, **request) == expected, kwargs
        assert streamed(qwen3_client, model.name, **request) == expected, kwargs


def test_chat_template_kwargs_refusals(frontend, qwen3):
    refused(lambda: chat(chat_template_kwargs=[1]), "chat_template_kwargs", "must be an object")
    refused(lambda: chat(chat_template_kwargs="x"), "chat_template_kwargs", "got a JSON string")
    refused(lambda: chat(chat_template_kwargs={"messages": [], "tools": [], "ok": 1}), "chat_template_kwargs",
            "must not set messages, tools")
    refused(lambda: chat(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs",
            "add_generation_prompt")
    assert chat(chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs == {"enable_thinking": False}
    assert chat().chat_template_kwargs == {}
    for url in (frontend.base_url + "/v1/chat/completions", qwen3.base_url + "/tokenize"):
        for kwargs in ({"bos_token": "x"}, 3, ["enable_thinking"]):
            status, _, raw = http("POST", url, body={"messages": say("x"), "chat_template_kwargs": kwargs})
            error = json.loads(raw)["error"]
            assert (status, error["param"]) == (400, "chat_template_kwargs"), (url, error)
    status, _, raw = http("GET", frontend.base_url + "/openapi.json")
    schemas = json.loads(raw)["components"]["schemas"]
    assert schemas["ChatCompletionRequest"]["properties"]["chat_template_kwargs"]["type"] == "object"
    assert schemas["TokenizeRequest"]["oneOf"][1]["properties"]["chat_template_kwargs"]["type"] == "object"


def test_the_flag_reaches_the_frontend_from_serve(capsys, tiny_model_dir):
    import argparse

    from services.cli import build_parser
    from services.command_flags import frontend_argv
    from services.frontend.config import FrontendConfig
    from services.frontend.main import add_frontend_arguments, frontend_config_from_args
    from services.frontend.served_model import load_served_model
    from shared.endpoints import Endpoints

    argv = frontend_argv(build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"]))
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert "--reasoning-parser" not in frontend_argv(build_parser().parse_args(["serve"]))
    parser = argparse.ArgumentParser()
    add_frontend_arguments(parser)
    endpoint = ["--request-endpoint", "ipc:///tmp/x.sock"]
    assert frontend_config_from_args(parser.parse_args([*endpoint, *argv])).reasoning_parser == "qwen3"
    assert frontend_config_from_args(parser.parse_args(endpoint)).reasoning_parser is None
    with pytest.raises(SystemExit):
        parser.parse_args([*endpoint, "--reasoning-parser", "granite"])
    assert "invalid choice: 'granite'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--reasoning-parser must be one of deepseek_r1, qwen3"):
        FrontendConfig(endpoints=Endpoints.in_directory("/tmp"), reasoning_parser="granite")
    config = FrontendConfig(model=str(tiny_model_dir), endpoints=Endpoints.in_directory("/tmp"), port=0,
                            reasoning_parser="deepseek_r1")
    assert load_served_model(config).reasoning_parser == "deepseek_r1"
