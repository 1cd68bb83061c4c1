"""A multimodal Gemma 3 checkpoint (``model_type`` ``gemma3``: the 4B/12B/27B's layout, here a
tiny random one from transformers' config classes, saved as safetensors) served as its text model
through the real loading path (``load_hf_config``, ``load_weights``, ``build_runner``): greedy
output token-identical in float32 to transformers' ``Gemma3ForConditionalGeneration`` given text
only, and the image tower's tensors left out."""

from __future__ import annotations

import torch

from services.executor.loader import RunnerOptions, build_runner
from services.executor.weights import load_hf_config, load_weights
from services.offline import EngineCore
from shared.hf_config import read_config_json
from shared.messages import AddRequest, SamplingParams
from shared.model_source import ModelSource
from tests.doubles.engine import hf_greedy
from tests.doubles.families import COMMON, FAMILY_SPECS, random_prompts


def tiny_multimodal(seed: int = 7):
    import transformers

    text = transformers.Gemma3TextConfig(**{**COMMON, **FAMILY_SPECS["gemma3_text"][2]})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                       image_token_index=127, boi_token_index=125, eoi_token_index=126)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model


def test_a_multimodal_checkpoint_serves_its_text_model(tmp_path):
    model = tiny_multimodal()
    model.save_pretrained(tmp_path)
    assert read_config_json(str(tmp_path))["model_type"] == "gemma3_text"
    source = ModelSource("tiny-gemma3", str(tmp_path))
    config = load_hf_config(source)
    assert config.model_type == "gemma3_text"
    state, _ = load_weights(source, config, "auto")
    assert any("vision_tower" in name for name in state)  # in the file; the family leaves it out
    runner = build_runner(config, state, RunnerOptions(dtype=torch.float32, num_kv_blocks=64, block_size=4,
                                                       num_cpu_blocks=0, attention_backend="torch"))
    assert not any("vision" in name for name in runner.model.state_dict())
    engine = EngineCore(runner)
    prompts = random_prompts((5, 19), seed=6, vocab_size=120)  # below the image tokens' ids
    for i, prompt in enumerate(prompts):
        engine.add_request(AddRequest(f"r{i}", torch.tensor(prompt, dtype=torch.int32).numpy(),
                                      SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), 0.0))
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, prompt in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(model, prompt, 10), f"prompt {i}"
