"""The offline engine, ``services.offline.LLM``: Hugging Face's greedy output for an in-memory model,
and the server's greedy output for the same model directory and prompts."""

from __future__ import annotations

import pytest
import torch

from services.offline import LLM
from shared.messages import SamplingParams
from tests.doubles.engine import tiny_llama
from tests.doubles.engine import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=31)


@pytest.fixture(scope="module")
def llm(model):
    return LLM.from_hf_model(model, dtype=torch.float32, num_kv_blocks=64, block_size=4)


def test_in_memory_model_equals_transformers(model, llm):
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42]]
    outs = llm.generate(prompts, GREEDY)
    assert [o.choices[0].token_ids for o in outs] == [hf_greedy(model, p, 10) for p in prompts]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(o.choices[0].finish_reason == "length" and o.choices[0].text is None for o in outs)  # no tokenizer
    assert not llm.engine.has_work() and llm.engine.blocks.num_used_blocks == 0


def test_one_prompt_several_choices_and_per_prompt_params(model, llm):
    [out] = llm.generate([3, 1, 4, 1, 5], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=3))
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.token_ids == hf_greedy(model, [3, 1, 4, 1, 5], 6) for c in out.choices)
    short, long = llm.generate([[7, 7], [8, 8]], [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                                                  SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)])
    assert (len(short.choices[0].token_ids), len(long.choices[0].token_ids)) == (2, 5)


def test_refused_prompt_raises_and_leaves_nothing_behind(llm):
    with pytest.raises(ValueError, match="prompt 1: the prompt has 300 tokens; the limit is 255"):
        llm.generate([[1, 2], [1 + i % 100 for i in range(300)]], GREEDY)
    assert not llm.engine.has_work() and llm.engine.blocks.num_used_blocks == 0
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")
    with pytest.raises(ValueError, match=r"prompt: token id 128 is out of range \[0, 128\) \(the model's vocabulary\)"):
        llm.generate([[1, 2], [5, 128]], GREEDY)  # the tiny model embeds 128 ids
    assert not llm.engine.has_work() and llm.engine.blocks.num_used_blocks == 0
    with pytest.raises(TypeError, match="unknown options \\['num_gpus'\\]"):
        LLM.from_hf_model(tiny_llama(), num_gpus=1)


@pytest.fixture(scope="module")
def served(tiny_model_dir, tiny_f32_server):
    """(model directory, URL of ``pagedserve serve`` on it in float32: the session's, conftest.py)."""
    return tiny_model_dir, tiny_f32_server[0]


@pytest.mark.slow
def test_llm_generate_equals_the_servers_greedy_output(served):
    from openai import OpenAI

    model_dir, url = served
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,", [5, 6, 7, 8, 9]]
    replies = [client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0) for p in prompts]
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_memory="16MiB")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    assert [o.choices[0].text for o in outs] == [r.choices[0].text for r in replies]
    assert [len(o.choices[0].token_ids) for o in outs] == [r.usage.completion_tokens for r in replies]
    assert [o.choices[0].finish_reason for o in outs] == [r.choices[0].finish_reason for r in replies]
    assert len({o.choices[0].text for o in outs}) == len(prompts)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    [chat] = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16))
    assert chat.choices[0].text == reply.choices[0].message.content
    assert len(chat.prompt_token_ids) == reply.usage.prompt_tokens


@pytest.mark.slow  # loads the embedded model's tokenizer and template
def test_chat_renders_conversations_with_the_template():
    """``LLM.chat``: the tokenizer's template or one given, one conversation or several; the prompt
    ids are the rendered text's without special tokens added, as a chat request's."""
    from tests.doubles.fake_scheduler import cached_tokenizer

    tokenizer = cached_tokenizer()
    llm = LLM.from_hf_model(tiny_llama(seed=32, vocab_size=len(tokenizer)), tokenizer, dtype=torch.float32,
                            num_kv_blocks=64, block_size=4)
    messages = [{"role": "user", "content": "Hi"}]
    [out] = llm.chat(messages, GREEDY)
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.prompt_token_ids == list(want) and out.prompt.endswith("assistant\n")
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    both = llm.chat([messages, [{"role": "user", "content": "Bye"}]], GREEDY, chat_template=template)
    assert [o.prompt for o in both] == ["[user] Hi\n", "[user] Bye\n"]
    assert both[0].prompt_token_ids == tokenizer("[user] Hi\n", add_special_tokens=False)["input_ids"]
    assert all(len(o.choices[0].token_ids) == 10 for o in both)
    with pytest.raises(ValueError, match="cannot apply the chat template"):
        llm.chat(messages, GREEDY, chat_template="{{ messages[0].missing.deeper }}")
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM.from_hf_model(tiny_llama(), num_kv_blocks=8, block_size=4).chat(messages)


@pytest.mark.slow  # loads a model from disk with its generation config
def test_prompts_without_sampling_params_sample_as_the_model_recommends(tmp_path, tiny_model_dir):
    """As vLLM's ``LLM``: the model's generation_config.json recommendations (``--generation-config
    auto``'s) are what ``generate`` uses when given no ``SamplingParams``."""
    import json
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    config.update(temperature=0.0, top_k=7, max_new_tokens=5)
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=32, block_size=4)
    assert llm.default_sampling_params == SamplingParams(temperature=0.0, top_k=7, max_tokens=5)
    [out] = llm.generate("The capital of France is")
    [greedy] = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=5))
    assert out.choices[0].token_ids == greedy.choices[0].token_ids and len(out.choices[0].token_ids) <= 5
    assert LLM.from_hf_model(tiny_llama(), num_kv_blocks=8, block_size=4).default_sampling_params == SamplingParams()


@pytest.mark.slow  # loads the embedded SmolLM2
def test_the_readmes_llm_example_runs_as_printed(capsys):
    from tests.docs.readme_blocks import readme_block

    namespace: dict = {}
    exec(compile(readme_block("python", "LLM()"), "README.md", "exec"), namespace)
    first, ids = namespace["outputs"]
    assert ids.prompt_token_ids == [1, 2, 3] and first.prompt == "The capital of France is"
    for out in (first, ids):
        [choice] = out.choices
        assert 0 < len(choice.token_ids) <= 16 and choice.finish_reason in ("length", "stop") and choice.text
    assert len(capsys.readouterr().out.splitlines()) == 2
