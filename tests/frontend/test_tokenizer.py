"""``--tokenizer``: the frontend's tokenizer from another directory than the model's; requests are
held to the ids the model embeds when that tokenizer has more."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys

import openai
import pytest

from services.frontend.config import FrontendConfig
from services.frontend.served_model import load_served_model
from shared.endpoints import Endpoints
from shared.model_source import ModelSource, resolve_model, resolve_tokenizer
from tests.doubles.fake_scheduler import FakeScheduler, FrontendThread, cached_tokenizer, default_served_model


def _split(tmp_path, tiny_model_dir):
    """The tiny model's directory without its tokenizer files, and a directory with only them."""
    model_dir, tokenizer_dir = tmp_path / "weights", tmp_path / "tokenizer"
    model_dir.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, model_dir / name)
    cached_tokenizer().save_pretrained(tokenizer_dir)
    return model_dir, tokenizer_dir


def test_resolve_tokenizer(tmp_path):
    model = ModelSource("m", str(tmp_path))
    assert resolve_tokenizer(None, model) is model
    assert resolve_tokenizer(str(tmp_path), model) == ModelSource(tmp_path.name, str(tmp_path))
    assert resolve_tokenizer("default", model).directory == resolve_model(None, convert_gguf=False).directory
    with pytest.raises(ValueError, match=r"--tokenizer .*missing: not a directory or a \.gguf file"):
        resolve_tokenizer(str(tmp_path / "missing"), model)


def test_model_and_tokenizer_from_separate_directories(tmp_path, tiny_model_dir):
    model_dir, tokenizer_dir = _split(tmp_path, tiny_model_dir)
    endpoints = Endpoints.in_directory(str(tmp_path))
    with pytest.raises(ValueError, match=r"^--model .*weights: cannot load the tokenizer"):
        load_served_model(FrontendConfig(model=str(model_dir), endpoints=endpoints, port=0))
    served = load_served_model(FrontendConfig(model=str(model_dir), tokenizer=str(tokenizer_dir), endpoints=endpoints,
                                              port=0))
    assert served.name == "weights" and len(served.tokenizer) == len(cached_tokenizer())
    assert served.model_vocab_size == len(cached_tokenizer())  # the tiny model embeds all of them
    (tokenizer_dir / "tokenizer.json").write_text("{")
    with pytest.raises(ValueError, match=r"^--tokenizer .*tokenizer: cannot load the tokenizer"):
        load_served_model(FrontendConfig(model=str(model_dir), tokenizer=str(tokenizer_dir), endpoints=endpoints,
                                         port=0))


def test_serve_passes_it_on_and_refuses_a_missing_one(tmp_path):
    from services.cli import build_parser
    from services.launcher import executor_argv, frontend_argv

    args = build_parser().parse_args(["serve", "--tokenizer", str(tmp_path)])
    for argv in (frontend_argv(args), executor_argv(args)):  # the executor masks guided requests over its tokens
        assert argv[argv.index("--tokenizer") + 1] == str(tmp_path)
    assert build_parser().parse_args(["executor", *executor_argv(args)]).tokenizer == str(tmp_path)
    assert "--tokenizer" not in executor_argv(build_parser().parse_args(["serve"]))
    run = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--tokenizer", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip().endswith("nope: not a directory or a .gguf file")


def test_ids_beyond_the_models_vocabulary_are_a_400(tmp_path):
    """A tokenizer with more tokens than the model embeds: token-id prompts, texts that tokenize
    beyond the model's vocabulary and logit_bias are refused with the reason; the rest is served."""
    tokenizer = cached_tokenizer()
    text = "The capital of France is Paris"
    ids = tokenizer(text)["input_ids"]
    bound = max(ids)  # the model embeds every id of the text but its largest
    model = dataclasses.replace(default_served_model(max_model_len=256), model_vocab_size=bound)
    assert model.vocab_size == bound
    endpoints = Endpoints.in_directory(str(tmp_path))
    fake = FakeScheduler(endpoints, tokenizer).start()
    server = FrontendThread(model, endpoints).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        for call, param, fragment in [
            (lambda: client.completions.create(model=model.name, prompt=[1, bound], max_tokens=2), "prompt",
             f"token id {bound} is out of range [0, {bound})"),
            (lambda: client.completions.create(model=model.name, prompt=text, max_tokens=2), "prompt",
             f"the text tokenizes to id {bound}, beyond the model's vocabulary of {bound}"),
            (lambda: client.chat.completions.create(model=model.name, max_tokens=2,
                                                    messages=[{"role": "user", "content": text}]), "messages",
             "beyond the model's vocabulary"),
            (lambda: client.completions.create(model=model.name, prompt=[1, 2], max_tokens=2,
                                               logit_bias={str(bound): 1.0}), "logit_bias",
             f"token id {bound} is out of range"),
        ]:
            with pytest.raises(openai.BadRequestError) as failure:
                call()
            assert failure.value.body["param"] == param and fragment in failure.value.body["message"]
        client.completions.create(model=model.name, prompt=[1, bound - 1], max_tokens=2)
        assert fake.added[-1].prompt_token_ids.tolist() == [1, bound - 1]
    finally:
        server.stop()
        fake.stop()

