"""Field validation, prompt lengths, configuration and flags of the frontend (no server)."""

from __future__ import annotations

import argparse

import pytest

from services.frontend.config import FrontendConfig
from services.frontend.main import add_frontend_arguments, frontend_config_from_args
from services.frontend.preprocess import chat_prompt_ids, completion_inputs, sampling_params
from services.frontend.errors import APIError
from services.frontend.request_body import parse_chat_body, parse_completion_body, parse_json_body
from shared.endpoints import Endpoints
from tests.doubles.fake_scheduler import default_served_model

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
    assert parse_completion_body({"prompt": "x"}, NAME).prompts == ["x"]  # model may be left out
    assert (opts.min_p, opts.presence_penalty, opts.frequency_penalty, opts.repetition_penalty) == (0, 0, 0, 1)
    assert (opts.logit_bias, opts.logprobs, completion().echo) == ({}, None, False)


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
        ("n", 129, "n must be between 1 and 128, got 129"),
        ("n", 0, "between 1 and 128"),
        ("n", "2", "must be an integer"),
        ("best_of", 129, "best_of must be between 1 and 128"),
        ("best_of", 0, "between 1 and 128"),
        ("use_beam_search", "yes", "must be a boolean"),
        ("length_penalty", "x", "must be a number"),
        ("early_stopping", "sometimes", 'early_stopping must be true, false or "never"'),
        ("echo", "yes", "must be a boolean"),
        ("logprobs", 21, "between 0 and 20, got 21"),
        ("logprobs", -1, "between 0 and 20"),
        ("logprobs", True, "must be an integer"),
        ("presence_penalty", 2.5, "between -2 and 2, got 2.5"),
        ("frequency_penalty", -3, "between -2 and 2"),
        ("repetition_penalty", 0, "(0, 2]"),
        ("repetition_penalty", "x", "must be a number"),
        ("min_p", 1.5, "between 0 and 1"),
        ("temperature", 10**400, "finite number"),
        ("logit_bias", [1], "must be an object"),
        ("logit_bias", {"abc": 1}, "token ids (integers), got 'abc'"),
        ("logit_bias", {"-3": 1}, "negative"),
        ("logit_bias", {"5": 101}, "between -100 and 100"),
        ("logit_bias", {"5": "1"}, "between -100 and 100, got string"),
        ("logit_bias", {str(i): 1 for i in range(1025)}, "at most 1024"),
        ("suffix", "tail", "not supported"),
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
    opts = completion(min_p=0.1, presence_penalty=-2, frequency_penalty=1.5, repetition_penalty=1.2,
                      logit_bias={"5": 10, "7": -100.0}, logprobs=3, best_of=1).options
    assert (opts.min_p, opts.presence_penalty, opts.frequency_penalty, opts.repetition_penalty) == (0.1, -2, 1.5, 1.2)
    assert (opts.logit_bias, opts.logprobs) == ({5: 10.0, 7: -100.0}, 3)
    assert completion(echo=True).echo is True


def test_chat_logprobs():
    assert chat().options.logprobs is None
    assert chat(logprobs=True).options.logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).options.logprobs == 5
    assert chat(logprobs=False).options.logprobs is None
    rejects(lambda: chat(top_logprobs=2), "top_logprobs", "needs logprobs set to true")
    rejects(lambda: chat(logprobs=True, top_logprobs=21), "top_logprobs", "between 0 and 20")
    rejects(lambda: chat(logprobs=1), "logprobs", "must be a boolean")


def test_stream_options_need_stream():
    rejects(lambda: completion(stream_options={"include_usage": True}), "stream_options", "only allowed when stream")
    rejects(lambda: completion(stream=True, stream_options={"include_usage": "y"}), "stream_options.include_usage")


def test_prompts():
    assert completion(prompt=[1, 2, 3]).prompts == [[1, 2, 3]]
    assert completion(prompt=["only one"]).prompts == ["only one"]
    assert completion(prompt=[[4, 5]]).prompts == [[4, 5]]
    assert completion(prompt=["a", "b"]).prompts == ["a", "b"]
    assert completion(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    rejects(lambda: completion(prompt=["a", [1]]), "prompt", "a list of strings, a list of token ids")
    rejects(lambda: completion(prompt=["a", ""]), "prompt", "prompt[1] must not be empty")
    rejects(lambda: completion(prompt=[[1], ["x"]]), "prompt", "prompt[1] must be a list of integer token ids")
    rejects(lambda: completion(prompt=["a"] * 65), "prompt", "at most 64 prompts", "got 65")
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
    rejects(lambda: chat(messages=[{"role": "function", "content": "x"}]), "messages[0].role",
            "system, developer, user, assistant, tool")
    rejects(lambda: chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content", "only text content parts")
    rejects(lambda: chat(messages=[{"role": "user", "content": 5}]), "messages[0].content")
    rejects(lambda: chat(tools=[{"type": "function"}]), "tools", "tools[0].function must be an object")


# ---------------------------------------------------------------- tokens and lengths


def test_prompt_ids_and_default_max_tokens(model):
    body = completion(prompt="Hello world")
    (prompt,) = completion_inputs(body, model)
    ids = prompt.token_ids
    assert ids == model.tokenizer.encode("Hello world") and prompt.text is None
    echoed = completion_inputs(completion(prompt=["Hi", "there"], echo=True), model)
    assert [p.text for p in echoed] == ["Hi", "there"]
    (echoed_ids,) = completion_inputs(completion(prompt=ids, echo=True), model)
    assert echoed_ids.text == "Hello world"
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
    assert params.eos_token_ids == model.eos_token_ids and params.logprobs is None
    rejects(lambda: sampling_params(completion(min_tokens=5, max_tokens=4).options, 3, model, 16, "prompt"),
            "min_tokens", "min_tokens must not exceed max_tokens (4), got 5")
    opts = completion(min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3,
                      logit_bias={"11": 5, "12": -5}, logprobs=2, top_k=10**9).options
    params = sampling_params(opts, 3, model, 16, "prompt")
    assert (params.min_p, params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.05, 0.5, -0.5, 1.3)
    assert (params.logit_bias_token_ids, params.logit_bias_values, params.logprobs) == ([11, 12], [5.0, -5.0], 2)
    assert params.top_k is None  # a top_k beyond the vocabulary is no top_k


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
    rejects(lambda: completion_inputs(completion(prompt=[1, model.vocab_size]), model), "prompt", "out of range")
    rejects(lambda: sampling_params(completion(logit_bias={str(model.vocab_size): 1}).options, 3, model, 16, "prompt"),
            "logit_bias", "out of range")
    rejects(lambda: sampling_params(completion(stop_token_ids=[10**6]).options, 3, model, 16, "prompt"),
            "stop_token_ids", "out of range")


# ---------------------------------------------------------------- configuration and flags


ENDPOINTS = Endpoints("ipc:///tmp/r.sock", "", "")


def test_config_validation():
    FrontendConfig(endpoints=ENDPOINTS)
    for kwargs, fragment in [
        ({"port": 70000}, "--port"),
        ({"port": "80"}, "--port"),
        ({"max_model_len": 0}, "--max-model-len"),
        ({"served_model_name": " "}, "--served-model-name"),
        ({"host": ""}, "--host"),
        ({"endpoints": Endpoints("", "", "")}, "--request-endpoint is required"),
        ({"endpoints": Endpoints("http://x", "", "")}, "--request-endpoint must start with"),
        ({"max_queue_len": 0}, "--max-queue-len must be a positive integer"),
        ({"api_key": " key"}, "--api-key must not be empty"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            FrontendConfig(**({"endpoints": ENDPOINTS} | kwargs))


def test_flags(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_REQUEST_ENDPOINT", "tcp://127.0.0.1:5555")
    parser = argparse.ArgumentParser()
    add_frontend_arguments(parser)
    config = frontend_config_from_args(parser.parse_args(["--port", "9000", "--served-model-name", "m",
                                                          "--max-model-len", "512"]))
    assert (config.port, config.served_model_name, config.max_model_len, config.host) == (9000, "m", 512, "127.0.0.1")
    assert config.endpoints.request == "tcp://127.0.0.1:5555"
    args = parser.parse_args(["--request-endpoint", "ipc:///tmp/x.sock"])
    assert frontend_config_from_args(args).endpoints.request == "ipc:///tmp/x.sock"
    assert frontend_config_from_args(args, ENDPOINTS).endpoints == ENDPOINTS  # a launcher's endpoints win

    limited = frontend_config_from_args(parser.parse_args(["--max-queue-len", "8", "--api-key", "k1"]))
    assert (limited.max_queue_len, limited.api_key) == (8, "k1") and "k1" not in repr(limited)
    assert frontend_config_from_args(parser.parse_args([])).api_key is None

    monkeypatch.delenv("PAGEDSERVE_REQUEST_ENDPOINT")
    bare = argparse.ArgumentParser()
    add_frontend_arguments(bare)
    with pytest.raises(ValueError, match="--request-endpoint is required"):
        frontend_config_from_args(bare.parse_args([]))


def test_serve_forwards_the_frontend_limits(monkeypatch, tmp_path):
    from services.cli import build_parser
    from services.launcher import frontend_argv, frontend_env

    args = build_parser().parse_args(["serve", "--max-queue-len", "5", "--api-key", "k2",
                                      "--http-write-timeout-s", "7"])
    argv = frontend_argv(args)
    assert argv[argv.index("--max-queue-len") + 1] == "5" and argv[argv.index("--http-write-timeout-s") + 1] == "7.0"
    # The key reaches the frontend in its environment, never on an argv (which /proc shows to everyone).
    assert not any("k2" in arg for arg in argv) and frontend_env(args, {})["PAGEDSERVE_API_KEY"] == "k2"
    assert "PAGEDSERVE_API_KEY" not in frontend_env(build_parser().parse_args(["serve"]), {})
    parser = argparse.ArgumentParser()
    add_frontend_arguments(parser)
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("PAGEDSERVE_API_KEY_FILE", str(key_file))  # a compose secret
    assert frontend_config_from_args(parser.parse_args([]), ENDPOINTS).api_key == "from-file"
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")  # the frontend child reads it from its environment
    assert frontend_config_from_args(parser.parse_args([]), ENDPOINTS).api_key == "from-env"
    monkeypatch.delenv("PAGEDSERVE_API_KEY")
    monkeypatch.setenv("PAGEDSERVE_API_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="PAGEDSERVE_API_KEY_FILE: cannot read"):
        frontend_config_from_args(parser.parse_args([]), ENDPOINTS)
