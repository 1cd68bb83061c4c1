"""Field validation, prompt lengths, configuration and flags of the frontend (no server)."""

from __future__ import annotations

import argparse

import pytest

from services.frontend.config import FrontendConfig
from services.frontend.main import add_frontend_arguments, frontend_config_from_args
from services.frontend.preprocess import chat_prompt_ids, completion_prompt_ids, sampling_params
from services.frontend.errors import APIError
from services.frontend.protocol import parse_chat_body, parse_completion_body, parse_json_body
from services.frontend.testing import default_served_model
from shared.endpoints import Endpoints

NAME = "served-model"


@pytest.fixture(scope="module")
def model():
    return default_served_model(max_model_len=64, name=NAME)


def completion(**fields):
    return parse_completion_body({"model": NAME, "prompt": "Hello"} | fields, NAME)


def chat(**fields):
    return parse_chat_body({"model": NAME, "messages": [{"role": "user", "content": "hi"}]} | fields, NAME)


def rejects(fn, param, *fragments):
    with pytest.raises(APIError) as info:
        fn()
    err = info.value
    assert err.status == 400 and err.type == "invalid_request_error"
    assert err.param == param, err.message
    for fragment in fragments:
        assert fragment in err.message, err.message
    return err


# ---------------------------------------------------------------- body and fields


def test_json_body():
    assert parse_json_body(b'{"a": 1}') == {"a": 1}
    rejects(lambda: parse_json_body(b'{"model": '), None, "not valid JSON")
    rejects(lambda: parse_json_body(b"\xff\xfe"), None, "not valid JSON")
    rejects(lambda: parse_json_body(b'{"temperature": NaN}'), None, "not valid JSON")
    rejects(lambda: parse_json_body(b"[1, 2]"), None, "must be a JSON object", "array")


def test_defaults():
    opts = completion().options
    assert (opts.max_tokens, opts.temperature, opts.top_p, opts.top_k, opts.seed) == (None, 1.0, 1.0, None, None)
    assert (opts.stream, opts.include_usage, opts.stop, opts.ignore_eos) == (False, False, [], False)
    assert parse_completion_body({"prompt": "x"}, NAME).prompt == "x"  # model may be left out


def test_model_name():
    err = rejects(lambda: completion(model="gpt-4"), "model", "`gpt-4` does not exist", NAME)
    assert err.code == "model_not_found"
    rejects(lambda: chat(model=3), "model", "must be a string")


@pytest.mark.parametrize("value", [0, -1])
def test_max_tokens_must_be_positive(value):
    rejects(lambda: completion(max_tokens=value), "max_tokens", f"at least 1, got {value}")
    rejects(lambda: chat(max_completion_tokens=value), "max_completion_tokens", f"got {value}")
    rejects(lambda: chat(max_tokens=value), "max_tokens")


def test_max_completion_tokens_wins_in_chat():
    opts = chat(max_tokens=5, max_completion_tokens=7).options
    assert (opts.max_tokens, opts.max_tokens_param) == (7, "max_completion_tokens")
    assert completion(max_tokens=16.0).options.max_tokens == 16


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("max_tokens", "10", "must be an integer, got string"),
        ("max_tokens", 1.5, "must be an integer"),
        ("max_tokens", True, "must be an integer, got boolean"),
        ("temperature", "hot", "must be a number, got string"),
        ("temperature", -0.1, "between 0 and 2"),
        ("temperature", 2.5, "between 0 and 2"),
        ("top_p", 0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_p", [1], "must be a number, got array"),
        ("top_k", -2, "top_k must be"),
        ("top_k", 2.5, "must be an integer"),
        ("seed", "x", "must be an integer"),
        ("seed", 2**70, "64 bits"),
        ("stream", "yes", "must be a boolean"),
        ("ignore_eos", 1, "must be a boolean"),
        ("min_tokens", -1, "at least 0"),
        ("stop", 5, "string or a list of strings"),
        ("stop", ["a", "b", "c", "d", "e"], "at most 4"),
        ("stop", [""], "must not be empty"),
        ("stop_token_ids", [1, "a"], "token ids"),
        ("n", 2, "n > 1 is not supported yet"),
        ("n", 0, "at least 1"),
        ("echo", True, "not supported"),
        ("logprobs", 2, "not supported"),
        ("presence_penalty", 0.5, "not supported"),
        ("best_of", 3, "not supported"),
    ],
)
def test_bad_fields_name_their_param(field, value, fragment):
    rejects(lambda: completion(**{field: value}), field, fragment)


def test_accepted_fields():
    opts = completion(
        temperature=0, top_p=0.5, top_k=-1, seed=-5, stop="\n", ignore_eos=True, stream=True,
        stream_options={"include_usage": True}, n=1, min_tokens=2, max_tokens=4, stop_token_ids=[7],
        presence_penalty=0, frequency_penalty=0.0, logprobs=None, echo=False, user="someone", unknown_field={"x": 1},
    ).options
    assert (opts.temperature, opts.top_p, opts.top_k, opts.seed, opts.stop) == (0.0, 0.5, None, -5, ["\n"])
    assert (opts.ignore_eos, opts.stream, opts.include_usage, opts.min_tokens) == (True, True, True, 2)
    assert completion(top_k=0).options.top_k is None and completion(top_k=40).options.top_k == 40
    rejects(lambda: completion(min_tokens=5, max_tokens=4), "min_tokens", "must not exceed")


def test_stream_options_need_stream():
    rejects(lambda: completion(stream_options={"include_usage": True}), "stream_options", "only allowed when stream")
    rejects(lambda: completion(stream=True, stream_options={"include_usage": "y"}), "stream_options.include_usage")


def test_prompts():
    assert completion(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert completion(prompt=["only one"]).prompt == "only one"
    assert completion(prompt=[[4, 5]]).prompt == [4, 5]
    rejects(lambda: completion(prompt=["a", "b"]), "prompt", "a list of 2 prompts", "not supported yet")
    rejects(lambda: completion(prompt=""), "prompt", "must not be empty")
    rejects(lambda: completion(prompt=[]), "prompt", "must not be empty")
    rejects(lambda: completion(prompt=None), "prompt", "required")
    rejects(lambda: completion(prompt={"a": 1}), "prompt", "got object")


def test_messages():
    body = chat(messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ])
    assert body.messages == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
    ]
    rejects(lambda: chat(messages=[]), "messages", "non-empty list")
    rejects(lambda: chat(messages=None), "messages", "required")
    rejects(lambda: chat(messages=["hi"]), "messages[0]", "must be an object")
    rejects(lambda: chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].role", "system, user, assistant")
    rejects(lambda: chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content", "only text content parts")
    rejects(lambda: chat(messages=[{"role": "user", "content": 5}]), "messages[0].content")
    rejects(lambda: chat(tools=[{"type": "function"}]), "tools", "not supported")


# ---------------------------------------------------------------- tokens and lengths


def test_prompt_ids_and_default_max_tokens(model):
    body = completion(prompt="Hello world")
    ids = completion_prompt_ids(body, model)
    assert ids == model.tokenizer.encode("Hello world")
    assert sampling_params(body.options, len(ids), model, 16, "prompt").max_tokens == 16
    assert sampling_params(body.options, 60, model, 16, "prompt").max_tokens == 4  # a default shrinks to fit
    chat_body = chat()
    chat_ids = chat_prompt_ids(chat_body, model)
    assert chat_ids == model.tokenizer.apply_chat_template(
        chat_body.messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert sampling_params(chat_body.options, len(chat_ids), model, None, "messages").max_tokens == 64 - len(chat_ids)


def test_sampling_params_carry_the_fields(model):
    opts = completion(temperature=0.5, top_p=0.9, top_k=5, seed=3, max_tokens=8, min_tokens=1, ignore_eos=True,
                      stop_token_ids=[9]).options
    params = sampling_params(opts, 3, model, 16, "prompt")
    assert (params.n, params.temperature, params.top_p, params.top_k, params.seed) == (1, 0.5, 0.9, 5, 3)
    assert (params.max_tokens, params.min_tokens, params.ignore_eos, params.stop_token_ids) == (8, 1, True, [9])


def test_length_limits(model):
    rejects(lambda: sampling_params(completion().options, 100, model, 16, "prompt"), "prompt",
            "prompt has 100 tokens", "limit is 64")
    rejects(lambda: sampling_params(completion().options, 64, model, 16, "prompt"), "prompt", "has 64 tokens")
    rejects(lambda: sampling_params(completion(max_tokens=20).options, 50, model, 16, "prompt"), "max_tokens",
            "maximum context length is 64", "50 prompt tokens", "20 max_tokens", "at most 14")
    assert sampling_params(completion(max_tokens=14).options, 50, model, 16, "prompt").max_tokens == 14
    rejects(lambda: sampling_params(chat(max_completion_tokens=60).options, 10, model, None, "messages"),
            "max_completion_tokens", "60 max_completion_tokens")


def test_token_id_ranges(model):
    rejects(lambda: completion_prompt_ids(completion(prompt=[1, model.vocab_size]), model), "prompt", "out of range")
    rejects(lambda: sampling_params(completion(stop_token_ids=[10**6]).options, 3, model, 16, "prompt"),
            "stop_token_ids", "out of range")


# ---------------------------------------------------------------- configuration and flags


ENDPOINTS = Endpoints("ipc:///tmp/r.sock", "ipc:///tmp/o.sock", "", "")


def test_config_validation():
    FrontendConfig(endpoints=ENDPOINTS)
    for kwargs, fragment in [
        ({"port": 70000}, "--port"),
        ({"port": "80"}, "--port"),
        ({"max_model_len": 0}, "--max-model-len"),
        ({"served_model_name": " "}, "--served-model-name"),
        ({"host": ""}, "--host"),
        ({"endpoints": Endpoints("", "ipc:///o", "", "")}, "--request-endpoint is required"),
        ({"endpoints": Endpoints("ipc:///r", "http://x", "", "")}, "--output-endpoint must start with"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            FrontendConfig(**({"endpoints": ENDPOINTS} | kwargs))


def test_flags(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_REQUEST_ENDPOINT", "tcp://127.0.0.1:5555")
    monkeypatch.setenv("PAGEDSERVE_OUTPUT_ENDPOINT", "tcp://127.0.0.1:5556")
    parser = argparse.ArgumentParser()
    add_frontend_arguments(parser)
    config = frontend_config_from_args(parser.parse_args(["--port", "9000", "--served-model-name", "m",
                                                          "--max-model-len", "512"]))
    assert (config.port, config.served_model_name, config.max_model_len, config.host) == (9000, "m", 512, "127.0.0.1")
    assert (config.endpoints.request, config.endpoints.output) == ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556")
    args = parser.parse_args(["--output-endpoint", "ipc:///tmp/x.sock"])
    assert frontend_config_from_args(args).endpoints.output == "ipc:///tmp/x.sock"
    assert frontend_config_from_args(args, ENDPOINTS).endpoints == ENDPOINTS  # a launcher's endpoints win

    monkeypatch.delenv("PAGEDSERVE_REQUEST_ENDPOINT")
    bare = argparse.ArgumentParser()
    add_frontend_arguments(bare)
    with pytest.raises(ValueError, match="--request-endpoint is required"):
        frontend_config_from_args(bare.parse_args([]))
