"""Prompt scoring through the whole server, as lm-eval-harness's ``local-completions`` does it:
``echo`` with ``logprobs`` and ``max_tokens`` 0 or 1 through the official ``openai`` client, and
vLLM's ``prompt_logprobs``; every value equals Hugging Face's log-softmax on the same tiny model
(float32), the prompt prefilled in 16-token chunks, with or without a cached prefix."""

from __future__ import annotations

import pytest
import torch

from tests.doubles.serve import tiny_server

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
PROMPTS = ["The capital of France is Paris, and the capital of Italy is Rome; the capital of Spain is",
           "Question: what is two plus two, and what is three times three? Answer: four and nine, in that order"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """(the Hugging Face model, the tokenizer, an ``openai`` client of the server on it)."""
    from openai import OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model_dir
    server = tiny_server(tmp_path_factory, "serve-scoring", "--served-model-name", "tiny", "--dtype", "float32",
                         "--kv-cache-memory", "16MiB", "--block-size", "4", "--max-num-batched-tokens", "16",
                         model_dir=model_dir)
    url = next(server)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    yield model, AutoTokenizer.from_pretrained(model_dir), OpenAI(base_url=f"{url}/v1", api_key="unused",
                                                                   max_retries=0, timeout=120)
    next(server, None)  # stops it


def hf_prompt_logprobs(model, prompt_ids: list[int]) -> tuple[list[float], torch.Tensor]:
    """(each prompt token's logprob after the first, [len - 1, vocab] the distributions they come from)."""
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0, :-1].float(), dim=-1)
    return ref.gather(1, torch.tensor(prompt_ids[1:]).unsqueeze(1)).squeeze(1).tolist(), ref


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_equal_transformers_whole_and_streamed(served, max_tokens):
    model, tokenizer, client = served
    args = dict(model="tiny", prompt=PROMPTS, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, **args))
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer.encode(prompt)
        assert len(ids) > 16  # prefilled in chunks
        want, ref = hf_prompt_logprobs(model, ids)
        choice = whole.choices[i]
        assert choice.index == i and choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert_close(lp.token_logprobs[1:len(ids)], want)
        assert len(lp.tokens) == len(ids) + max_tokens == len(lp.text_offset) == len(lp.top_logprobs)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]
        assert "".join(lp.tokens) == choice.text and choice.text.startswith(prompt)
        top_values = torch.topk(ref, 2).values
        for j, top in enumerate(lp.top_logprobs[1:len(ids)]):  # the top 2 and the prompt token
            assert 1 <= len(top) <= 3 and abs(max(top.values()) - top_values[j, 0].item()) < TOLERANCE
        streamed = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(c.text for c in streamed) == choice.text
        joined = [x for c in streamed if c.logprobs for x in c.logprobs.token_logprobs]
        assert joined == lp.token_logprobs  # the same values, whole or streamed
        assert [x for c in streamed if c.logprobs for x in c.logprobs.text_offset] == lp.text_offset
        assert streamed[-1].finish_reason == "length"
    assert whole.usage.completion_tokens == max_tokens * len(PROMPTS)


def test_a_cached_prefix_is_scored_all_the_same(served):
    model, tokenizer, client = served
    prompt = PROMPTS[0] + " Madrid."
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)  # the prefix is in the cache now
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    scored = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    assert scored.usage.prompt_tokens_details.cached_tokens == 0  # computed, to be scored
    want, _ = hf_prompt_logprobs(model, tokenizer.encode(prompt))
    assert_close(scored.choices[0].logprobs.token_logprobs[1:], want)


def test_vllm_prompt_logprobs_equal_transformers(served):
    model, tokenizer, client = served
    result = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 3})
    ids = tokenizer.encode(PROMPTS[1])
    want, ref = hf_prompt_logprobs(model, ids)
    entries = result.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert_close([entries[j + 1][str(t)]["logprob"] for j, t in enumerate(ids[1:])], want)
    for j, ranked in enumerate(entries[1:]):  # the prompt token, then the top 3 (one may be it)
        assert len(ranked) in (3, 4) and next(iter(ranked)) == str(ids[j + 1])
        assert sorted(e["rank"] for t, e in ranked.items() if t != str(ids[j + 1]))[-1] <= 3
        assert_close([e["logprob"] for e in ranked.values()], [ref[j, int(t)].item() for t in ranked])
        assert all(e["decoded_token"] == tokenizer.decode([int(t)]) for t, e in ranked.items())
