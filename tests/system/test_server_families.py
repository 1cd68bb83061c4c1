"""``pagedserve serve`` on tiny random checkpoints of the newer families, saved as a user's model
directory with SmolLM2's tokenizer: the official openai client's greedy completions (whole and
streamed, prompts longer than the sliding window) are transformers' text."""

from __future__ import annotations

import pytest

from tests.doubles.engine import hf_greedy
from tests.doubles.families import tiny_family

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]


@pytest.mark.slow  # starts the whole server, once per family
@pytest.mark.parametrize("name", ["qwen3", "gemma2", "mistral"])
def test_served_family_completes_as_transformers(tmp_path, name):
    from tests.doubles.fake_scheduler import cached_tokenizer
    from tests.doubles.serve import openai_client, start_server, stop

    tokenizer = cached_tokenizer()
    model = tiny_family(name, seed=9, vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path / name)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert max(len(p) for p in prompts) > 9  # longer than every tiny window
    wants = [tokenizer.decode(hf_greedy(model, p, 12)) for p in prompts]
    proc, url = start_server(tmp_path, "--model", str(tmp_path / name), "--tokenizer", str(tmp_path / "tokenizer"),
                             "--served-model-name", name, "--dtype", "float32", "--kv-cache-memory", "16MiB")
    try:
        client = openai_client(url)
        for prompt, want in zip(prompts, wants):
            resp = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True})
            assert resp.choices[0].text == want
            stream = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in stream if c.choices) == want
    finally:
        stop(proc)
