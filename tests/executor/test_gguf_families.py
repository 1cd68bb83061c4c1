"""A Qwen3 GGUF file, as llama.cpp's converter writes one, served through the product's GGUF path
(read by transformers into the converted cache, then our Qwen3): greedy output equals the original
model's in transformers."""

from __future__ import annotations

import pytest
import torch

from tests.doubles.engine import hf_greedy
from tests.doubles.families import random_prompts, tiny_family
from tests.doubles.gguf_writer import write_qwen3_gguf


@pytest.mark.slow  # transformers reads and converts the GGUF file (about 10 s)
def test_a_qwen3_gguf_is_served_as_its_model(tmp_path, monkeypatch):
    from services.executor.loader import RunnerOptions, build_runner
    from services.executor.weights import load_hf_config, load_state_dict
    from services.offline import EngineCore
    from shared.messages import AddRequest, SamplingParams
    from shared.model_source import resolve_model

    monkeypatch.setenv("PAGEDSERVE_GGUF_CACHE", str(tmp_path / "cache"))
    # Qwen3's head_dim is not in the GGUF keys transformers reads: its default (128) is what real
    # Qwen3 checkpoints use, so the tiny model uses it too
    model = tiny_family("qwen3", seed=3, vocab_size=49152, hidden_size=64, head_dim=128, num_attention_heads=4)
    path = tmp_path / "tiny-qwen3.gguf"
    write_qwen3_gguf(model, str(path))
    source = resolve_model(str(path))
    config = load_hf_config(source)
    assert config.model_type == "qwen3"
    runner = build_runner(config, load_state_dict(source), RunnerOptions(dtype=torch.float32, num_kv_blocks=32,
                                                                         block_size=4))
    engine = EngineCore(runner)
    prompts = random_prompts((5, 12), seed=2, vocab_size=49152)
    for i, prompt in enumerate(prompts):
        engine.add_request(AddRequest(f"r{i}", torch.tensor(prompt, dtype=torch.int32).numpy(),
                                      SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), 0.0))
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(model, prompt, 10)
