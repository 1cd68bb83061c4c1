"""Mistral's tool calls when ``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens, as in Mistral's own
tokenizers: on a tiny tokenizer (SmolLM2's with the two added as special tokens), the detokenizer
keeps the parser's markers for "auto" requests (what ``decode`` with ``skip_special_tokens=False``
gives, the EOS still dropped) and drops them otherwise; through the frontend against the fake engine
saying them (v3's array and v11's ``name[ARGS]{...}``) the calls come back whole and streamed; and
through ``pagedserve serve`` on a tiny random model with that tokenizer, a grammar that forces the
special tokens (llguidance's ``<[id]>``) makes the engine write a v11 call that "auto" reads."""

from __future__ import annotations

import copy
import dataclasses
import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.served_model import ServedModel
from services.frontend.tool_parsers import kept_special_ids
from shared.endpoints import Endpoints
from shared.model_source import eos_token_ids
from tests.doubles.fake_scheduler import FakeScheduler, FrontendThread, cached_tokenizer
from tests.frontend.test_tool_calls import TOOLS, say

MARKS = ["[TOOL_CALLS]", "[ARGS]"]
V11 = 'Sure.[TOOL_CALLS]get_time[ARGS]{"zone": "東京"}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
V3 = 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "東京"}}]'
CALLS = [("get_time", '{"zone": "東京"}'), ("get_weather", '{"city": "Paris"}')]


@pytest.fixture(scope="module")
def tokenizer():
    tok = copy.deepcopy(cached_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": MARKS})
    return tok


def test_the_markers_are_kept_for_auto_requests_only(tokenizer):
    ids = tokenizer.encode(V11, add_special_tokens=False) + [tokenizer.eos_token_id]
    marks = set(tokenizer.convert_tokens_to_ids(MARKS))
    assert marks <= set(ids) and kept_special_ids("mistral", tokenizer, True) == marks
    assert kept_special_ids("mistral", tokenizer, False) == kept_special_ids("hermes", tokenizer, True) == set()

    def detokenized(keep):
        detokenizer = IncrementalDetokenizer(tokenizer, keep_special=keep)
        return "".join(detokenizer.add([i]) for i in ids) + detokenizer.finish()

    assert detokenized(frozenset(marks)) == tokenizer.decode(ids[:-1], skip_special_tokens=False) == V11
    assert detokenized(frozenset()) == tokenizer.decode(ids, skip_special_tokens=True) == V11.replace(
        "[TOOL_CALLS]", "").replace("[ARGS]", "")


@pytest.fixture(scope="module")
def mistral(tokenizer, tmp_path_factory):
    endpoints = Endpoints.in_directory(str(tmp_path_factory.mktemp("zmq")))
    fake = FakeScheduler(endpoints, tokenizer).start()
    served = ServedModel("tiny-mistral", tokenizer, 1024, eos_token_ids(tokenizer, None), tool_parser="mistral")
    server = FrontendThread(served, endpoints).start()
    yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=20)
    server.stop()
    fake.stop()


@pytest.mark.parametrize("text, calls", [(V11, CALLS), (V3, CALLS[:1])])
def test_calls_in_special_tokens_whole_and_streamed(mistral, text, calls):
    fields = {"model": "tiny-mistral", "messages": say(text), "tools": TOOLS}
    whole = mistral.chat.completions.create(**fields).choices[0]
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == calls
    assert (whole.message.content, whole.finish_reason) == ("Sure.", "tool_calls")
    state = ChatCompletionStreamState()
    for chunk in mistral.chat.completions.create(**fields, stream=True):
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == calls
    assert (streamed.message.content, streamed.finish_reason) == ("Sure.", "tool_calls")
    plain = mistral.chat.completions.create(**fields, tool_choice="none").choices[0]  # no parser: no markers
    assert plain.message.content == text.replace("[TOOL_CALLS]", "").replace("[ARGS]", "")


@pytest.mark.slow  # starts pagedserve serve
def test_the_engine_writes_the_special_tokens_and_auto_reads_them(tokenizer, tmp_path_factory):
    from tests.doubles.engine import tiny_llama
    from tests.doubles.serve import start_server, stop

    model_dir = tmp_path_factory.mktemp("tiny-mistral")
    tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=256).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    calls_id, args_id = tokenizer.convert_tokens_to_ids(MARKS)
    grammar = f'start: "Sure." <[{calls_id}]> "get_time" <[{args_id}]> "{{\\"zone\\": \\"UTC\\"}}"'
    proc, url = start_server(tmp_path_factory.mktemp("serve-mistral"), "--model", str(model_dir), "--dtype",
                             "float32", "--kv-cache-memory", "16MiB", "--enable-auto-tool-choice",
                             "--tool-call-parser", "mistral")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        fields = {"model": str(model_dir), "messages": [{"role": "user", "content": "The time?"}], "tools": TOOLS,
                  "max_tokens": 40, "extra_body": {"guided_grammar": grammar}}
        models = client.models.list().data
        fields["model"] = models[0].id
        whole = client.chat.completions.create(**fields).choices[0]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == [
            ("get_time", {"zone": "UTC"})]
        assert (whole.message.content, whole.finish_reason) == ("Sure.", "tool_calls")
        with client.chat.completions.stream(**fields) as stream:
            streamed = stream.get_final_completion().choices[0]
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        free = client.chat.completions.create(**{**fields, "tool_choice": "none"}).choices[0]
        assert free.message.content == 'Sure.get_time{"zone": "UTC"}'  # no parser: the special tokens dropped
    finally:
        stop(proc)
