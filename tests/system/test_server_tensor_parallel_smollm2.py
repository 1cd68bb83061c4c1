"""Tensor parallelism through the real ``pagedserve serve`` processes, on SmolLM2-135M (9 heads, 3 KV
heads): ``-tp 3`` over shared memory gives transformers' greedy tokens, token for token, with its
logprobs within float32 noise (``-tp 1`` gives them too: ``tests/offline/test_smollm2_vs_hf.py``,
``tests/system/test_server.py``). The tiny-model runs, two hosts and lost ranks:
``tests/system/test_server_tensor_parallel.py``.
"""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from tests.doubles.serve import openai_client, start_server, stop
from tests.system.test_server_tensor_parallel import _choices, _get

pytestmark = pytest.mark.slow

SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
SMOLLM2_MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2_reference():
    """transformers' greedy tokens for each prompt, each token as its own text (as logprobs show it),
    and each token's logprob."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.model_source import resolve_model

    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.directory, **src.pretrained_kwargs())
    model = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32, **src.pretrained_kwargs()).eval()
    refs = []
    for prompt in SMOLLM2_PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=SMOLLM2_MAX_TOKENS,
                                 do_sample=False, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        new_ids = out.sequences[0, ids.shape[1]:].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, new_ids)]
        refs.append({"tokens": [tok.decode([t], skip_special_tokens=False) for t in new_ids], "logprobs": logprobs})
    return refs


# -tp 1 against transformers, token for token: tests/offline/test_smollm2_vs_hf.py and tests/system/test_server.py.
# Shared memory only: the torch (gloo) all-reduce sums three ranks as shared memory does
# (tests/executor/parallel/test_allreduce_torch.py, world size 3), and serve over it gives -tp 1's tokens and logprobs
# (test_two_hosts_over_torch_distributed) and survives a killed rank (torch-killed below)
@pytest.mark.parametrize("all_reduce", ["shm"])
def test_smollm2_tp3_equals_transformers(all_reduce, tmp_path, smollm2_reference):
    proc, url = start_server(tmp_path, "-tp", "3", "--all-reduce", all_reduce, "--dtype", "float32", "--max-model-len",
                       "512", "--kv-cache-memory", "64MiB", "--swap-space", "0.05")
    try:
        client = openai_client(url)
        with concurrent.futures.ThreadPoolExecutor(len(SMOLLM2_PROMPTS)) as pool:
            replies = list(pool.map(lambda p: client.completions.create(
                model="SmolLM2-135M-Instruct", prompt=p, max_tokens=SMOLLM2_MAX_TOKENS, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True}), SMOLLM2_PROMPTS))
        health = json.loads(_get(f"{url}/health"))
    finally:
        stop(proc)
    for i, (run, ref) in enumerate(zip((_choices(r)[0] for r in replies), smollm2_reference)):
        assert run["tokens"] == ref["tokens"], f"prompt {i}: {run['text']!r} != {''.join(ref['tokens'])!r}"
        # 30 layers of sums split over 3 ranks and added in another order: float32 noise only
        assert max(abs(x - y) for x, y in zip(run["logprobs"], ref["logprobs"], strict=True)) < 1e-3
    assert health["group"]["world_size"] == 3 and health["group"]["all_reduce"] == all_reduce
