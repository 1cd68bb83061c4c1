"""OPT (``services/executor/opt.py``): greedy outputs equal transformers' token for token, for the
pre-norm models and the 350M's layout (norms after the sublayers, projections between the
embedding and hidden widths), on both CPU backends; checkpoints named from ``OPTModel``; shards
with row-parallel biases; the memory estimate; the errors for what it does not take."""

import dataclasses

import pytest
import torch

from services.executor.architectures import model_class, model_config
from services.executor.opt import OPTConfig as OurOPTConfig
from services.executor.opt import OPTForCausalLM as OurOPT
from services.executor.parallel.sharding import ShardPlan, shard_state_dict
from shared.hf_config import model_shape, weight_bytes
from tests.doubles.engine import InProcessEngine
from tests.doubles.engine import hf_greedy


def tiny_opt(seed: int = 0, **overrides):
    """A small random Hugging Face OPT (2 layers, 4 heads) whose biases and norm weights are random
    too (transformers starts them at 0 and 1, which would leave their paths untested)."""
    from transformers import OPTConfig, OPTForCausalLM

    kwargs = dict(vocab_size=128, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=128, word_embed_proj_dim=64, pad_token_id=1, bos_token_id=2,
                  eos_token_id=2)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = OPTForCausalLM(OPTConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "layer_norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _prompts(seed: int, lengths=(1, 3, 4, 5, 8, 13, 17, 30, 2, 9)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]


def _engine_greedy(engine, prompts, max_new):
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        engine.add(f"r{i}", p, temperature=0.0, max_tokens=m, ignore_eos=True)
    got = engine.run()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return [got[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_tiny_opt_batch_matches_transformers(backend):
    model = tiny_opt(seed=1)
    prompts = _prompts(0)
    max_new = [12, 20, 7, 16, 25, 9, 14, 11, 18, 5]
    engine = InProcessEngine(model, num_blocks=128, block_size=4, backend=backend, max_num_batched_tokens=48)
    got = _engine_greedy(engine, prompts, max_new)
    assert engine.mixed_steps > 0, "prefill and decode never shared a step"
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        assert got[i] == hf_greedy(model, p, m), f"request {i} (prompt length {len(p)}) differs"
    assert len({tuple(g) for g in got}) > 5  # the model does not just repeat one token


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_opt_350m_layout_matches_transformers(backend):
    """``do_layer_norm_before: false`` (no final norm) and ``word_embed_proj_dim`` below the hidden size."""
    model = tiny_opt(seed=2, do_layer_norm_before=False, word_embed_proj_dim=32)
    ours = InProcessEngine(model, block_size=4, backend=backend).runner.model
    assert ours.model.decoder.final_layer_norm is None and ours.model.decoder.project_in is not None
    prompts = _prompts(1, lengths=(6, 11, 2))
    got = _engine_greedy(InProcessEngine(model, block_size=4, backend=backend), prompts, [15, 15, 15])
    assert got == [hf_greedy(model, p, 15) for p in prompts]


def test_tiny_opt_bf16_agrees_with_transformers_bf16():
    """bfloat16 (the numba backend's 16-bit caches and ``--linear-kernel auto``'s matmuls, with
    biases): greedy tokens agree with transformers' in bfloat16 on at least 90% of the first 32, as
    the SmolLM2 bfloat16 test asks."""
    model = tiny_opt(seed=1)
    prompts = _prompts(3, lengths=(5, 9, 17, 3))
    got = _engine_greedy(InProcessEngine(model, block_size=4, backend="numba", dtype=torch.bfloat16), prompts,
                         [32] * len(prompts))
    reference = model.to(torch.bfloat16)
    agree = sum(a == b for g, p in zip(got, prompts) for a, b in zip(g, hf_greedy(reference, p, 32)))
    assert agree >= 0.9 * 32 * len(prompts), f"{agree} of {32 * len(prompts)} tokens agree"


@pytest.mark.slow  # saves and loads two checkpoints
def test_checkpoint_saved_from_opt_model_and_untied_head():
    """Names starting at ``decoder.`` (as ``OPTModel`` saves them) load; so does an untied LM head."""
    from services.executor.loader import RunnerOptions, build_runner

    model = tiny_opt(seed=3)
    state = {k: v for k, v in model.model.state_dict().items()}  # "decoder.layers.0...", no lm_head
    assert all(k.startswith("decoder.") for k in state)
    runner = build_runner(model.config, state, RunnerOptions(dtype=torch.float32, block_size=4, num_kv_blocks=32))
    assert torch.equal(runner.model.lm_head.weight, model.lm_head.weight)
    untied = tiny_opt(seed=4, tie_word_embeddings=False)
    with torch.no_grad():
        untied.lm_head.weight.normal_()
    prompt = [7, 3, 9, 12]
    engine = InProcessEngine(untied, block_size=4)
    assert _engine_greedy(engine, [prompt], [10]) == [hf_greedy(untied, prompt, 10)]


def test_model_classes_by_type():
    assert model_class(tiny_opt().config) is OurOPT
    assert isinstance(model_config(tiny_opt().config), OurOPTConfig)
    gelu = tiny_opt(activation_function="gelu")
    prompt = [4, 8, 15, 16, 23, 42]
    assert _engine_greedy(InProcessEngine(gelu, block_size=4), [prompt], [8]) == [hf_greedy(gelu, prompt, 8)]
    with pytest.raises(ValueError, match="OPT activation 'silu' is not supported"):
        model_config(tiny_opt(activation_function="silu").config)
    from transformers import GPT2Config

    with pytest.raises(ValueError, match=r"model type 'gpt2' is not supported \(supported: llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3_text, opt\)"):
        model_class(GPT2Config())


def test_shards_of_opt_split_row_parallel_biases_onto_rank_zero():
    model = tiny_opt(seed=5)
    state = model.state_dict()
    cfg = model_config(model.config)
    shards = [shard_state_dict(state, ShardPlan.for_model(cfg, r, 2)) for r in range(2)]
    prefix = "model.decoder.layers.0."
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.bias", "fc1.weight", "fc1.bias"):
        assert torch.equal(torch.cat([s[prefix + name] for s in shards]), state[prefix + name])
    for name in ("self_attn.out_proj.weight", "fc2.weight"):
        assert torch.equal(torch.cat([s[prefix + name] for s in shards], dim=1), state[prefix + name])
    for name in ("self_attn.out_proj.bias", "fc2.bias"):
        assert torch.equal(shards[0][prefix + name], state[prefix + name]) and not shards[1][prefix + name].any()
    vocab = torch.cat([s["model.decoder.embed_tokens.weight"] for s in shards])
    assert torch.equal(vocab, state["model.decoder.embed_tokens.weight"])
    for name in ("model.decoder.embed_positions.weight", prefix + "final_layer_norm.bias"):
        assert all(torch.equal(s[name], state[name]) for s in shards)


def test_tiny_opt_sharded_equals_unsharded():
    """Two ranks over the shared-memory all-reduce: rank 0's logits equal the whole model's (so each
    row-parallel bias is added once), with copy-on-write copies and swaps in the steps."""
    from tests.executor.test_tensor_parallel_model import _prompts as tp_prompts
    from tests.executor.test_tensor_parallel_model import check_sharded_equals_unsharded

    steps = check_sharded_equals_unsharded(tiny_opt(seed=6), 2, tp_prompts(128), max_tokens=12, num_blocks=16,
                                           max_num_batched_tokens=24, preemption_mode="swap")
    assert any(len(s.block_copies) for s in steps) and any(len(s.swap_out) for s in steps)


def test_memory_estimate_counts_opt_weights():
    """``weight_bytes`` on OPT-125M's and OPT-350M's shapes against their parameters (built on the
    meta device): within 1% (it leaves out biases, the norms' biases and the 350M's projections)."""
    from transformers import OPTConfig, OPTForCausalLM

    for kwargs in ({}, {"hidden_size": 1024, "ffn_dim": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                        "word_embed_proj_dim": 512, "do_layer_norm_before": False}):
        config = OPTConfig(**kwargs)
        with torch.device("meta"):
            model = OPTForCausalLM(config)
        params = sum(p.numel() for p in model.parameters())  # the tied head counted once
        shape = model_shape(config.to_dict(), "opt")
        assert shape.intermediate_size == config.ffn_dim and shape.tie_word_embeddings
        assert shape.embedding_dim == config.word_embed_proj_dim
        assert abs(weight_bytes(shape, 4) / (4 * params) - 1) < 0.01
    llama_like = dataclasses.replace(shape, mlp_matrices=3)  # the gated MLP's third matrix
    assert weight_bytes(llama_like, 4) > weight_bytes(shape, 4)


@pytest.mark.slow  # starts the whole server
def test_served_tiny_opt_completes_as_transformers(tmp_path):
    """``pagedserve serve`` on a tiny random OPT saved as a model directory, with SmolLM2's tokenizer
    less its chat template (OPT's has none) from a directory of its own (``--tokenizer``): the
    official client's greedy completion is transformers' text, streamed or not, and a chat request
    is a clear 400."""
    import json

    import openai

    from tests.doubles.fake_scheduler import cached_tokenizer
    from tests.doubles.serve import openai_client, start_server, stop

    tokenizer = cached_tokenizer()
    model = tiny_opt(seed=7, vocab_size=len(tokenizer), max_position_embeddings=256)
    model_dir, tokenizer_dir = tmp_path / "tiny-opt", tmp_path / "tokenizer"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(tokenizer_dir)
    for path in tokenizer_dir.glob("*chat_template*"):
        path.unlink()
    settings = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(settings))
    prompt = tokenizer("The capital of France is")["input_ids"]
    want = tokenizer.decode(hf_greedy(model, prompt, 16))
    proc, url = start_server(tmp_path, "--model", str(model_dir), "--tokenizer", str(tokenizer_dir), "--served-model-name",
                       "tiny-opt", "--dtype", "float32", "--kv-cache-memory", "16MiB")
    try:
        client = openai_client(url)
        resp = client.completions.create(model="tiny-opt", prompt=prompt, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].text == want and resp.usage.completion_tokens == 16
        stream = client.completions.create(model="tiny-opt", prompt=prompt, max_tokens=16, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
        with pytest.raises(openai.BadRequestError, match="cannot apply the chat template"):
            client.chat.completions.create(model="tiny-opt", messages=[{"role": "user", "content": "Hi"}])
    finally:
        stop(proc)
    assert '"architecture": "OPTForCausalLM"' in (tmp_path / "serve.log").read_text()
