"""Scaled and partial rotary tables (``services/executor/rope.py``) against transformers, in float32:
Llama 3's ``llama3`` scaling, Qwen's ``yarn``, Phi-3.5's ``longrope`` and Phi-4-mini's partial
rotary, each a tiny random model from transformers' config classes: greedy output token for token
on the torch and numba backends, and prompt logprobs within 1e-4; the longrope table's long half;
the kinds refused in one line."""

from __future__ import annotations

import pytest
import torch

from services.executor.architectures import model_config
from services.executor.rope import Rope, cos_sin, rope_from_config
from tests.doubles.engine import hf_greedy
from tests.doubles.families import COMMON, engine_greedy, engine_prompt_logprobs, hf_prompt_logprobs, random_prompts

TOLERANCE = 1e-4
HALF = COMMON["head_dim"] // 2
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.3 * i for i in range(HALF)], "long_factor": [2.0 + 0.7 * i for i in range(HALF)]}
VARIANTS = {  # name -> (config class, model class, settings)
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64})),
    "longrope": ("Phi3Config", "Phi3ForCausalLM", dict(rope_parameters=LONGROPE, original_max_position_embeddings=64,
                                                       pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "partial": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1,
                                                      eos_token_id=2)),
}


def tiny(name: str, seed: int = 5):
    import transformers

    config_name, model_name, own = VARIANTS[name]
    config = getattr(transformers, config_name)(**{**COMMON, "tie_word_embeddings": False, **own})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request):
    return request.param, tiny(request.param)


def test_the_table_is_the_scaled_one(variant):
    name, model = variant
    rope = model_config(model.config).rope
    assert rope.rotary_dim == (HALF if name == "partial" else 2 * HALF)
    want = model.model.rotary_emb.inv_freq  # transformers' own buffer
    assert torch.equal(torch.tensor(rope.inv_freq, dtype=torch.float32), want.float())
    assert rope.attention_factor == pytest.approx(model.model.rotary_emb.attention_scaling)
    assert (rope.attention_factor != 1.0) == (name in ("yarn", "longrope"))


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_greedy_equals_transformers(variant, backend):
    name, model = variant
    prompts = random_prompts((3, 17, 26), seed=3)  # with 14 tokens each: below longrope's 64
    got = engine_greedy(model, prompts, 14, num_blocks=64, backend=backend)
    for i, prompt in enumerate(prompts):
        assert got[i] == hf_greedy(model, prompt, 14), f"{name}: prompt {i} of {len(prompt)} tokens"


def test_prompt_logprobs_equal_transformers(variant):
    name, model = variant
    prompt = random_prompts([23], seed=4)[0]
    torch.testing.assert_close(engine_prompt_logprobs(model, prompt), hf_prompt_logprobs(model, prompt),
                               atol=TOLERANCE, rtol=0)


def test_longrope_turns_to_its_long_factors_at_the_original_length():
    """Per position, as vLLM's table: short factors below ``original_max_position_embeddings``, the
    long ones (transformers' frequencies for a longer sequence) from there on."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = tiny("longrope")
    rope = model_config(model.config).rope
    long_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](model.config, torch.device("cpu"), seq_len=65)
    assert rope.original_max_positions == 64 and torch.equal(torch.tensor(rope.long_inv_freq), long_freq.double())
    cos, _ = cos_sin(rope, 100)
    positions = torch.arange(100, dtype=torch.float32)
    for freq, rows in ((torch.tensor(rope.inv_freq), slice(0, 64)), (long_freq, slice(64, 100))):
        emb = torch.outer(positions, freq.float())
        want = torch.cat((emb, emb), dim=-1).cos() * rope.attention_factor
        torch.testing.assert_close(cos[rows], want[rows], atol=0, rtol=0)


@pytest.mark.parametrize("params,match", [
    ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, "rope type 'dynamic' is not supported"),
    ({"rope_type": "made-up", "rope_theta": 1e4}, r"rope type 'made-up' is not supported \(supported: default"),
])
def test_refused_kinds_are_one_line_errors(params, match):
    with pytest.raises(ValueError, match=match):
        rope_from_config(tiny("llama3").config, params, COMMON["head_dim"], "model llama")
    assert isinstance(rope_from_config(None, None, 16, "x"), Rope)
