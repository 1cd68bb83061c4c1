"""``--chat-template`` (``services/frontend/chat_template.py``): a file or an inline template, checked
when the flags are read; the served tokenizer renders chat requests with it; ``pagedserve serve``
passes it on and refuses a bad one in one line."""

from __future__ import annotations

import argparse
import subprocess
import sys

import openai
import pytest

from services.frontend.chat_template import resolve_chat_template
from services.frontend.config import FrontendConfig
from services.frontend.flags import add_frontend_arguments
from services.frontend.main import frontend_config_from_args
from services.frontend.served_model import load_served_model
from shared.endpoints import Endpoints
from tests.doubles.fake_scheduler import FakeScheduler, FrontendThread

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_file_or_an_inline_template(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert resolve_chat_template(str(path)) == TEMPLATE
    assert resolve_chat_template(None) is None
    inline = TEMPLATE.replace("\n", "\\n")  # one line, as on a command line; its escapes decoded
    assert resolve_chat_template(inline) == TEMPLATE
    for value, message in [
        (str(tmp_path / "missing.jinja"), r"missing\.jinja: no such file \(an inline template holds Jinja tags"),
        ("  ", "must not be empty"),
        ("{% for m in messages %}{{ m.content }", r"not a valid Jinja template: unexpected '}' \(line 1\)"),
        ("{% if x %}", "not a valid Jinja template"),
    ]:
        with pytest.raises(ValueError, match=message):
            resolve_chat_template(value)
    # what transformers' environment adds: loop controls and the {% generation %} block
    extended = ("{% for m in messages %}{% if m.role == 'tool' %}{% continue %}{% endif %}"
                "{% generation %}{{ m.content }}{% endgeneration %}{% if loop.index > 8 %}{% break %}{% endif %}"
                "{% endfor %}")
    assert resolve_chat_template(extended) == extended
    (tmp_path / "bad.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ValueError, match="cannot read"):
        resolve_chat_template(str(tmp_path / "bad.jinja"))


def test_frontend_flag_and_serve_pass_it_on(tmp_path):
    from services.cli import build_parser
    from services.launcher import frontend_argv

    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    parser = argparse.ArgumentParser()
    add_frontend_arguments(parser)
    args = parser.parse_args(["--chat-template", str(path), "--request-endpoint", "ipc:///tmp/x.sock"])
    config = frontend_config_from_args(args)
    assert config.chat_template == TEMPLATE and TEMPLATE not in repr(config)
    argv = frontend_argv(build_parser().parse_args(["serve", "--chat-template", str(path)]))
    assert argv[argv.index("--chat-template") + 1] == str(path)
    assert "--chat-template" not in frontend_argv(build_parser().parse_args(["serve"]))
    run = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--chat-template", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--chat-template" in run.stderr and "no such file" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_chat_requests_render_with_the_given_template(tmp_path, tiny_model_dir):
    """The frontend's own loading path (``load_served_model``) over a model directory: a chat request
    reaches the scheduler as the template's rendering, tokenized."""
    endpoints = Endpoints.in_directory(str(tmp_path))
    config = FrontendConfig(model=str(tiny_model_dir), endpoints=endpoints, chat_template=TEMPLATE, port=0)
    model = load_served_model(config)
    fake = FakeScheduler(endpoints, model.tokenizer).start()
    server = FrontendThread(model, endpoints, chat_template=TEMPLATE).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
        client.chat.completions.create(model=model.name, messages=messages, max_tokens=4)
        rendered = "<system>Be brief.\n<user>Hi there\n<assistant>"
        want = model.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert fake.added[-1].prompt_token_ids.tolist() == want
    finally:
        server.stop()
        fake.stop()
