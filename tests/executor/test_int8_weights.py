"""``--quantization int8`` (``services/executor/int8_weights.py``): a Hugging Face model's matmul
weights and embeddings quantized at load to int8 with a scale per output channel. Each kernel
(torch's int8 kernel at few rows, dequantized tiles at many) equals the dequantized weight's
product within float rounding; a two-rank split adds up to one rank's product with the whole
rows' scales; a whole tiny model of each decoder family served in int8 gives the prompt logprobs
and greedy tokens of transformers running the same model on its int8 weights dequantized."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from services.executor.gguf_weights import choose_quantization
from services.executor.int8_weights import (INT8PACK_ROWS, Int8Embedding, Int8Linear, Int8Weight,
                                            quantize_state_int8, split_int8)
from services.executor.loader import RunnerOptions, build_runner
from services.executor.parallel.sharding import ShardPlan, shard_tensor
from services.offline import EngineCore
from shared.messages import AddRequest, SamplingParams
from tests.doubles.engine import hf_greedy
from tests.doubles.families import hf_prompt_logprobs, random_prompts, tiny_family
from tests.executor.test_quantized_gguf import greedy_engine


def int8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """Written from the definition: symmetric per row, max|w| -> 127 with the scale in bfloat16,
    rounded to nearest (a row of zeros, as Gemma's padding embedding, stays zeros)."""
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-30).bfloat16().float()
    return torch.round(w / scale).clamp(-127, 127) * scale


def dequantized_copy(model):
    """``model`` (transformers) with every weight int8 serves replaced by its round trip (Phi-3's
    fused ``qkv_proj`` / ``gate_up_proj`` whole: the scales are per row, so fused or split alike)."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.ndim == 2 and re.search(r"(_proj\.weight|embed_tokens\.weight|lm_head\.weight)$", name):
                t.copy_(int8_round_trip(t.float()))
    return model


def test_values_scales_and_what_stays_float():
    w = torch.randn(64, 96)
    state = {"model.layers.0.self_attn.q_proj.weight": w, "model.layers.0.input_layernorm.weight": torch.randn(96),
             "model.layers.0.self_attn.q_proj.bias": torch.randn(64)}
    out, scales = quantize_state_int8(state)
    q = out["model.layers.0.self_attn.q_proj.weight"]
    scale = scales["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.int8 and set(scales) == {"model.layers.0.self_attn.q_proj.weight"}
    assert torch.equal(scale, scale.bfloat16().float())  # the kernel's bfloat16 scale loses nothing
    torch.testing.assert_close(q * scale, int8_round_trip(w), rtol=0, atol=0)
    assert ((q * scale - w).abs() <= w.abs().amax(1, keepdim=True) / 127 * 0.51).all()  # half a step (+ the clamp)
    for kept in ("model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias"):
        assert out[kept] is state[kept]


@pytest.mark.parametrize("rows", [1, INT8PACK_ROWS - 1, INT8PACK_ROWS, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_matmul_equals_the_dequantized_weights(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    w, x, bias = torch.randn(45, 50, generator=gen), torch.randn(rows, 50, generator=gen), torch.randn(45, generator=gen)
    values, scales = quantize_state_int8({"a.q_proj.weight": w})
    q, scale = values["a.q_proj.weight"], scales["a.q_proj.weight"]
    layer = Int8Linear(Int8Weight(q, scale[:, 0]), bias.to(dtype))
    want = x @ (q * scale).T + bias
    got = layer(x.to(dtype)).float()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.1)
    torch.testing.assert_close(got, want, **tol)


def test_two_ranks_add_up_to_one_with_the_whole_rows_scales():
    plan = [ShardPlan(r, 2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, vocab_size=32) for r in (0, 1)]
    state = {"model.layers.0.mlp.down_proj.weight": torch.randn(32, 64), "model.layers.0.mlp.gate_proj.weight":
             torch.randn(64, 32), "model.layers.0.mlp.up_proj.weight": torch.randn(64, 32)}
    values, scales = quantize_state_int8(state)
    x, h = torch.randn(3, 64), torch.randn(3, 32)
    down, gate_up = [], []
    for p in plan:
        s = split_int8(scales, p)
        q = {n: shard_tensor(n, t, p) for n, t in values.items()}
        down.append(Int8Linear(Int8Weight(q["model.layers.0.mlp.down_proj.weight"].to(torch.int8),
                                          s["model.layers.0.mlp.down_proj.weight"][:, 0]), None)(x[:, p.rank * 32:][:, :32]))
        fused = torch.cat([q["model.layers.0.mlp.gate_proj.weight"], q["model.layers.0.mlp.up_proj.weight"]])
        gate_up.append(Int8Linear(Int8Weight(fused.to(torch.int8), s["model.layers.0.mlp.gate_up_proj.weight"][:, 0]), None)(h))
    whole = {n: values[n] * scales[n] for n in values}
    torch.testing.assert_close(down[0] + down[1], x @ whole["model.layers.0.mlp.down_proj.weight"].T, rtol=1e-5, atol=1e-5)
    want = h @ torch.cat([whole["model.layers.0.mlp.gate_proj.weight"].T[:, 32 * r:32 * r + 32] for r in (0, 1)] +
                         [whole["model.layers.0.mlp.up_proj.weight"].T[:, 32 * r:32 * r + 32] for r in (0, 1)], dim=1)
    got = torch.cat([torch.cat([g[:, :32] for g in gate_up], 1), torch.cat([g[:, 32:] for g in gate_up], 1)], 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3", "phi3", "gemma2"])
def test_a_model_served_in_int8_equals_transformers_on_the_dequantized_weights(name):
    model = tiny_family(name, seed=9)
    options = RunnerOptions(dtype=torch.float32, num_kv_blocks=64, block_size=4, num_cpu_blocks=0,
                            attention_backend="torch", quantization="int8")
    runner = build_runner(model.config, model.state_dict(), options)
    layers = model.config.num_hidden_layers
    assert sum(isinstance(m, Int8Linear) for m in runner.model.modules()) == 4 * layers + 1  # qkv, o, gate_up, down; head
    assert isinstance(runner.model.input_embeddings, Int8Embedding)
    prompt = random_prompts([21], seed=7)[0]
    float_logprobs = hf_prompt_logprobs(model, prompt)
    reference = dequantized_copy(model)
    want = hf_prompt_logprobs(reference, prompt)
    assert (want - float_logprobs).abs().max() > 1e-3  # int8 moves the logits: the check below can tell
    engine = EngineCore(runner)
    engine.add_request(AddRequest("p", np.array(prompt, dtype=np.int32),
                                  SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), 0.0))
    outs = [o for _ in iter(engine.has_work, False) for o in engine.step()]
    got = torch.tensor(next(o.prompt_logprobs for o in outs if o.prompt_logprobs))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    prompts = random_prompts((4, 15, 9), seed=8)
    assert greedy_engine(engine, prompts, 10) == [hf_greedy(reference, p, 10) for p in prompts]


def test_the_choice_per_device_and_family():
    assert choose_quantization("int8", False, "llama").mode == "int8"
    assert choose_quantization("int8", True, "qwen3").mode == "int8"  # a GGUF file: its dequantized weights
    assert choose_quantization("int8", False, "llama", "cuda").mode == "none"
    assert choose_quantization("int8", False, "opt").mode == "none"
    with pytest.raises(ValueError, match="--quantization must be auto, gguf, int8 or none"):
        RunnerOptions(quantization="int4")
