"""The fused q/k/v projection: loaded from Hugging Face's separate q_proj, k_proj and v_proj (whole,
or per tensor-parallel rank after sharding), with biases, giving transformers' logits."""

import torch

from services.executor.model import fuse_projections
from tests.doubles.engine import InProcessEngine


def test_fuse_projections_joins_q_k_v_rows_and_keeps_the_rest():
    state = {f"model.layers.0.self_attn.{p}_proj.{kind}": torch.full((n,) if kind == "bias" else (n, 2), float(i))
             for i, (p, n) in enumerate([("q", 4), ("k", 2), ("v", 2)]) for kind in ("weight", "bias")}
    state["model.layers.0.self_attn.o_proj.weight"] = torch.ones(2, 4)
    state["model.layers.1.self_attn.q_proj.weight"] = torch.ones(4, 2)  # no k/v: left for load_state_dict to report
    fused = fuse_projections(state)
    assert sorted(fused) == ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.qkv_proj.bias",
                             "model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.self_attn.q_proj.weight"]
    assert fused["model.layers.0.self_attn.qkv_proj.weight"][:, 0].tolist() == [0.0] * 4 + [1.0] * 2 + [2.0] * 2
    assert fused["model.layers.0.self_attn.qkv_proj.bias"].tolist() == [0.0] * 4 + [1.0] * 2 + [2.0] * 2
    assert "model.layers.0.self_attn.q_proj.weight" in state  # the input is not changed


def tiny_qwen2(seed: int):
    """Qwen2's attention: biases on q, k and v (none on o)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)).eval()


def test_attention_bias_through_the_fused_projection_matches_transformers():
    model = tiny_qwen2(seed=4)
    with torch.no_grad():
        for layer in model.model.layers:  # random biases (transformers starts them at zero)
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    prompt = [5, 17, 3, 99, 42, 7]
    engine = InProcessEngine(model, block_size=4)
    engine.add("r", prompt, temperature=0.0, max_tokens=6, ignore_eos=True)
    got = engine.run()["r"]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == want
