"""``--generation-config`` (``services/frontend/generation_defaults.py``): the model's recommended
sampling defaults reach the engine for the fields a request leaves out, as vLLM 0.32 applies them
(its length only as chat's default, and as a limit on every request when the file comes from a
directory of its own); the request's own values, beam search and ``vllm`` are left alone."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil

import openai
import pytest
import structlog

from services.frontend.config import FrontendConfig
from services.frontend.flags import add_frontend_arguments
from services.frontend.generation_defaults import read_generation_defaults
from services.frontend.main import frontend_config_from_args
from services.frontend.served_model import load_served_model
from shared.endpoints import Endpoints
from tests.doubles.fake_scheduler import FakeScheduler, FrontendThread, default_served_model

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1, "max_new_tokens": 5,
               "do_sample": True, "bos_token_id": 1}


def _write(directory, config) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))


def test_read_the_recommended_values(tmp_path):
    model_dir, other = tmp_path / "model", tmp_path / "other"
    _write(model_dir, RECOMMENDED)
    want = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 5}  # top_k 50: transformers'
    assert read_generation_defaults("auto", str(model_dir)) == want
    assert read_generation_defaults("vllm", str(model_dir)) == {}
    _write(other, {"temperature": 0.3, "top_k": 20, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5})
    assert read_generation_defaults(str(other), str(model_dir)) == {
        "temperature": 0.3, "top_k": 20, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5}
    assert read_generation_defaults("auto", str(tmp_path)) == {}  # no file: OpenAI's defaults
    with pytest.raises(ValueError, match="not auto, vllm, or a directory holding generation_config.json"):
        read_generation_defaults(str(tmp_path / "missing"), str(model_dir))
    _write(other, {"temperature": 7.0, "top_p": 0.0, "top_k": 0, "max_new_tokens": 0, "min_p": 0.1})
    with structlog.testing.capture_logs() as logs:
        assert read_generation_defaults(str(other), str(model_dir)) == {"min_p": 0.1}
    assert sorted(e["key"] for e in logs if e["event"] == "generation config value left out") == \
        ["max_new_tokens", "temperature", "top_p"]  # top_k 0 means off: no default, no warning
    (model_dir / "generation_config.json").write_text("{not json")
    with structlog.testing.capture_logs() as logs:
        assert read_generation_defaults("auto", str(model_dir)) == {}
    assert logs[0]["event"] == "generation config not read"
    with pytest.raises(ValueError, match="--generation-config: cannot read"):
        read_generation_defaults(str(model_dir), str(tmp_path))


def test_flag_serve_and_the_frontends_loading(tmp_path, tiny_model_dir):
    from services.cli import build_parser
    from services.launcher import frontend_argv

    parser = argparse.ArgumentParser()
    add_frontend_arguments(parser)
    endpoint = ["--request-endpoint", "ipc:///tmp/x.sock"]
    assert frontend_config_from_args(parser.parse_args(endpoint)).generation_config == "auto"
    assert frontend_config_from_args(parser.parse_args([*endpoint, "--generation-config", "vllm"])).generation_config \
        == "vllm"
    with pytest.raises(ValueError, match="--generation-config nope"):
        frontend_config_from_args(parser.parse_args([*endpoint, "--generation-config", "nope"]))
    argv = frontend_argv(build_parser().parse_args(["serve", "--generation-config", "vllm"]))
    assert argv[argv.index("--generation-config") + 1] == "vllm"
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    _write(model_dir, RECOMMENDED)
    endpoints = Endpoints.in_directory(str(tmp_path))
    loaded = load_served_model(FrontendConfig(model=str(model_dir), endpoints=endpoints, port=0))
    assert loaded.generation_defaults == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 5}
    assert loaded.max_tokens_limit is None  # auto: the model's length is chat's default, no limit
    plain = load_served_model(FrontendConfig(model=str(model_dir), endpoints=endpoints, port=0,
                                             generation_config="vllm"))
    assert plain.generation_defaults == {} and plain.max_tokens_limit is None
    other = tmp_path / "other"
    _write(other, {"max_new_tokens": 7, "temperature": 0.2})
    limited = load_served_model(FrontendConfig(model=str(model_dir), endpoints=endpoints, port=0,
                                               generation_config=str(other)))
    assert limited.generation_defaults == {"temperature": 0.2, "max_tokens": 7} and limited.max_tokens_limit == 7


def _frontend(tmp_path_factory, **model_fields):
    """A frontend over the fake scheduler, its model's fields replaced: (client, fake, model, stop)."""
    endpoints = Endpoints.in_directory(str(tmp_path_factory.mktemp("zmq")))
    model = dataclasses.replace(default_served_model(max_model_len=256), **model_fields)
    fake = FakeScheduler(endpoints, model.tokenizer).start()
    server = FrontendThread(model, endpoints).start()

    def stop():
        server.stop()
        fake.stop()

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0), fake, model, stop


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A frontend whose model recommends temperature 0.6, top_p 0.9, repetition_penalty 1.1 and 5
    tokens (``auto``), over the fake scheduler: (client, fake, model)."""
    client, fake, model, stop = _frontend(tmp_path_factory, generation_defaults={
        "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 5})
    yield client, fake, model
    stop()


def test_left_out_fields_take_the_models_defaults(served):
    client, fake, model = served
    client.completions.create(model=model.name, prompt="Hello")
    sent = fake.added[-1].sampling
    assert (sent.temperature, sent.top_p, sent.repetition_penalty) == (0.6, 0.9, 1.1)
    assert sent.top_k is None and sent.min_p == 0.0  # not recommended: OpenAI's
    assert sent.max_tokens == 16  # completions keep the API's default, as in vLLM
    client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "Hi"}])
    assert fake.added[-1].sampling.max_tokens == 5  # chat's default (the context left) gives way


def test_the_requests_own_values_win(served):
    client, fake, model = served
    client.completions.create(model=model.name, prompt="Hello", temperature=0.0, max_tokens=9,
                              extra_body={"repetition_penalty": 1.0})
    sent = fake.added[-1].sampling
    assert (sent.temperature, sent.top_p, sent.repetition_penalty, sent.max_tokens) == (0.0, 0.9, 1.0, 9)


def test_beam_search_takes_no_sampling_default(served):
    client, fake, model = served
    client.completions.create(model=model.name, prompt="Hello", n=2, extra_body={"use_beam_search": True})
    sent = fake.added[-1].sampling
    assert (sent.temperature, sent.top_p, sent.repetition_penalty) == (0.0, 1.0, 1.0) and sent.use_beam_search
    assert sent.max_tokens == 16


def test_a_directorys_length_limits_every_request(tmp_path_factory):
    client, fake, model, stop = _frontend(tmp_path_factory, generation_defaults={"max_tokens": 3},
                                          max_tokens_limit=3)
    try:
        for max_tokens in (None, 2, 9):
            client.completions.create(model=model.name, prompt="Hello", max_tokens=max_tokens)
            assert fake.added[-1].sampling.max_tokens == min(max_tokens or 16, 3)
        client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=50)
        assert fake.added[-1].sampling.max_tokens == 3
    finally:
        stop()
