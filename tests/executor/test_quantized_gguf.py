"""GGUF files served quantized (``--quantization gguf``): a tiny random Qwen3 written as a GGUF file
of mixed quantized types gives, served in its blocks, the greedy tokens of the same weights
dequantized by the ``gguf`` package and run through the plain float path; ``-tp 2`` cuts the blocks
on their edges and gives rank 0 the one-rank logits; a split inside a block is refused in one line."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from kernels.quant_reference import quant_matmul as reference_matmul
from services.executor.gguf_weights import QuantWeight, read_gguf
from services.executor.parallel.sharding import ShardPlan
from services.executor.quantized import QuantLinear, quantized_summary, shard_quantized
from services.executor.weights import build_model
from tests.doubles.families import random_prompts, tiny_family
from tests.doubles.gguf_blocks import random_quantized
from tests.doubles.gguf_writer import write_qwen3_gguf

# every served type, and fused projections of mixed types (q/k Q4_0 with v Q6_K; gate Q4_1 with up Q4_K)
QTYPES = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_0, "attn_v": T.Q6_K, "attn_output": T.Q4_K,
          "ffn_gate": T.Q4_1, "ffn_up": T.Q4_K, "ffn_down": T.Q8_0, "output": T.Q6_K}
VOCAB = 512


@pytest.fixture(scope="module")
def tiny_gguf():
    model = tiny_family("qwen3", seed=4, vocab_size=VOCAB, hidden_size=256, intermediate_size=256, head_dim=128,
                        num_attention_heads=4, num_key_value_heads=2)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny-qwen3.gguf")
        write_qwen3_gguf(model, path, QTYPES, tokenizer=False)
        yield model.config, path


def dequantized_state(path: str, config) -> dict:
    """The file's weights as float32 by the gguf package's own dequantizer."""
    state = read_gguf(path, config).state
    return {k: torch.from_numpy(gguf_dequantize(v.raw.numpy(), T(v.ggml_type)).copy())
            if isinstance(v, QuantWeight) else v for k, v in state.items()}


def greedy(model, prompts, max_tokens: int = 8) -> list[list[int]]:
    from services.executor.attention import select_backend
    from services.executor.runner import ModelRunner, allocate_kv_cache
    from services.offline import EngineCore

    kv = allocate_kv_cache(model.kv_cache_config, 64, 4, torch.float32, torch.device("cpu"))
    engine = EngineCore(ModelRunner(model, kv, select_backend("torch", torch.device("cpu")), torch.device("cpu")))
    return greedy_engine(engine, prompts, max_tokens)


def greedy_engine(engine, prompts, max_tokens: int) -> list[list[int]]:
    from shared.messages import AddRequest, SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(AddRequest(f"r{i}", np.array(prompt, dtype=np.int32),
                                      SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), 0.0))
    got: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [got[f"r{i}"] for i in range(len(prompts))]


def test_tiny_model_served_quantized_gives_the_dequantized_greedy_tokens(tiny_gguf):
    config, path = tiny_gguf
    cpu = torch.device("cpu")
    quantized = build_model(config, read_gguf(path, config).state, torch.float32, cpu, 256)
    plain = build_model(config, dequantized_state(path, config), torch.float32, cpu, 256)
    file_types = {}
    for t in GGUFReader(path).tensors:
        if t.tensor_type.name.startswith("Q"):
            file_types[t.tensor_type.name] = file_types.get(t.tensor_type.name, 0) + 1
    assert sum(isinstance(m, QuantLinear) for m in quantized.modules()) == 2 * 4 + 1  # qkv, o, gate_up, down; head
    summary = quantized_summary(quantized)
    # fused parts of one type join into one pack: q+k (Q4_0) are one pack per layer, as gate and up are two
    assert set(summary["quantized_types"]) == set(file_types)
    assert summary["weight_bytes"] < sum(p.numel() * 4 for p in plain.parameters()) / 2
    prompts = random_prompts((5, 12, 3), seed=2, vocab_size=VOCAB)
    assert greedy(quantized, prompts) == greedy(plain, prompts)


def _plan(rank: int, intermediate: int = 512) -> ShardPlan:
    return ShardPlan(rank, 2, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=intermediate,
                     vocab_size=VOCAB)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_tp_split_of_quantized_weights_adds_up_to_the_whole(qtype):
    from kernels.cpu.quant_matmul import pack, quant_matmul

    x = torch.randn(3, 512)
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.gate_proj.weight"):
        rows, cols = (256, 512) if "down" in name else (512, 512)
        w = QuantWeight(torch.from_numpy(random_quantized(qtype, rows, cols, seed=5)), int(qtype), cols)
        full = reference_matmul(x, w.raw, int(qtype))
        parts = [shard_quantized(name, w, _plan(r)) for r in (0, 1)]
        if "down" in name:  # row-parallel: each rank its half of the inputs, the all-reduce adds them
            got = sum(quant_matmul(x[:, r * 256:(r + 1) * 256], pack(p.raw, p.ggml_type)) for r, p in enumerate(parts))
        else:  # column-parallel: each rank its half of the outputs
            got = torch.cat([quant_matmul(x, pack(p.raw, p.ggml_type)) for p in parts], dim=-1)
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5 * full.abs().max().item())


def test_tp_split_inside_a_block_is_refused():
    w = QuantWeight(torch.from_numpy(random_quantized(T.Q4_K, 256, 768, seed=6)), int(T.Q4_K), 768)
    with pytest.raises(ValueError, match=r"down_proj\.weight \(Q4_K, blocks of 256\) would take inputs 0\.\.384, not whole blocks"):
        shard_quantized("model.layers.0.mlp.down_proj.weight", w, _plan(0, intermediate=768))


def _rank_worker(rank, world_size, report, spec, path, config, steps, reference):
    from tests.doubles.rank_group import make_communicator
    from tests.executor.test_tensor_parallel_model import NUM_CPU_BLOCKS, replay
    from services.executor.attention import select_backend

    comm = make_communicator("shm", rank, world_size, spec)
    model = build_model(config, read_gguf(path, config).state, torch.float32, torch.device("cpu"), 256,
                        ShardPlan.for_model(_cfg(config), rank, world_size), comm)
    outs, _ = replay(model, select_backend("torch", torch.device("cpu")), steps, 16, NUM_CPU_BLOCKS)
    if rank == 0:
        pairs = [(o, r) for o, r in zip(outs, reference) if r is not None]
        report({"max_err": max((o - r).abs().max().item() for o, r in pairs),
                "scale": max(r.abs().max().item() for _, r in pairs),
                "same_tokens": all(torch.equal(o.argmax(-1), r.argmax(-1)) for o, r in pairs)})
    comm.close()


def _cfg(config):
    from services.executor.architectures import model_config

    return model_config(config)


@pytest.mark.slow  # starts two rank processes (spawned: they import torch and the kernels again; about 4 s)
def test_two_ranks_serve_the_quantized_model_as_one(tiny_gguf):
    from tests.doubles.rank_group import RankGroup, new_group_id
    from tests.executor.test_tensor_parallel_model import NUM_CPU_BLOCKS, record_steps, replay
    from services.executor.attention import select_backend

    config, path = tiny_gguf
    hf = tiny_family("qwen3", seed=4, vocab_size=VOCAB, hidden_size=256, intermediate_size=256, head_dim=128,
                     num_attention_heads=4, num_key_value_heads=2)  # drives the scheduler's steps only
    steps = record_steps(hf, random_prompts((4, 9), seed=3, vocab_size=VOCAB), 6, num_blocks=16)
    full = build_model(config, read_gguf(path, config).state, torch.float32, torch.device("cpu"), 256)
    reference, _ = replay(full, select_backend("torch", torch.device("cpu")), steps, 16, NUM_CPU_BLOCKS)
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"group_id": new_group_id(), "store_path": os.path.join(tmp, "store")}
        group = RankGroup(_rank_worker, 2, spec, path, config, steps, reference, method="spawn")
        assert group.join(300) == [0, 0], group.messages
    result = group.wait_for(0, "max_err")
    assert result["same_tokens"]
    assert result["max_err"] < 1e-4 * result["scale"], result


@pytest.mark.slow  # loads SmolLM2 twice (quantized, and dequantized by transformers) and decodes 4 x 24 tokens
def test_smollm2_q4_1_served_quantized_agrees_with_the_dequantized_model():
    """The embedded Q4_1 file (llama: q/k rows un-permuted) served in its blocks against
    ``--quantization none`` (transformers' dequantized weights) in float32: the same sums in
    another order, so a near-tie may flip; at least 90 % of the greedy positions must agree (96/96
    did when it was written)."""
    from services.executor.loader import RunnerOptions, build_runner
    from services.executor.weights import load_hf_config, load_weights
    from services.offline import EngineCore
    from shared.model_source import resolve_model
    from transformers import AutoTokenizer

    source = resolve_model(None)
    config = load_hf_config(source)
    tok = AutoTokenizer.from_pretrained(source.directory)
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "Once upon a time",
                                       "Water boils at")]
    outputs = {}
    for mode in ("gguf", "none"):
        state, choice = load_weights(source, config, mode)
        assert choice.mode == mode
        runner = build_runner(config, state, RunnerOptions(dtype=torch.float32, num_kv_blocks=64, num_cpu_blocks=0))
        assert any(isinstance(m, QuantLinear) for m in runner.model.modules()) == (mode == "gguf")
        outputs[mode] = greedy_engine(EngineCore(runner), prompts, 24)
    same = sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
               for x, y in zip(outputs["gguf"], outputs["none"]))
    assert same >= 0.9 * 4 * 24, (same, outputs)


def test_quantization_choice():
    from services.executor.gguf_weights import choose_quantization

    assert choose_quantization("gguf", True, "llama").mode == "gguf"
    assert choose_quantization("auto", True, "llama").mode == "none"  # a batch decodes slower in blocks, measured
    assert "measured" in choose_quantization("auto", True, "llama").reason
    assert choose_quantization("none", True, "llama").mode == "none"
    assert choose_quantization("gguf", False, "llama").mode == "none"  # a Hugging Face directory
    assert choose_quantization("gguf", True, "gemma2").mode == "none"  # names this reader does not map
    assert choose_quantization("gguf", True, "qwen3", "cuda").mode == "none"  # CPU kernels only


def test_a_fused_projection_partly_quantized_is_served_in_float_whole():
    """As llama.cpp's Q4_K_M writes SmolLM2 (q and k Q5_0, dequantized at read; v Q8_0): the v part
    is dequantized too, by the reference, and the projection loads as float."""
    from kernels.quant_reference import dequantize
    from services.executor.quantized import take_quantized

    v = QuantWeight(torch.from_numpy(random_quantized(T.Q8_0, 64, 128, seed=3)), int(T.Q8_0), 128)
    down = QuantWeight(torch.from_numpy(random_quantized(T.Q8_0, 128, 64, seed=4)), int(T.Q8_0), 64)
    state = {"model.layers.0.self_attn.q_proj.weight": torch.randn(128, 128),
             "model.layers.0.self_attn.k_proj.weight": torch.randn(64, 128),
             "model.layers.0.self_attn.v_proj.weight": v, "model.layers.0.mlp.down_proj.weight": down}
    plain, quantized = take_quantized(state)
    assert set(quantized) == {"model.layers.0.mlp.down_proj.weight"}
    assert torch.equal(plain["model.layers.0.self_attn.v_proj.weight"], dequantize(v.raw, v.ggml_type))
    np.testing.assert_allclose(plain["model.layers.0.self_attn.v_proj.weight"].numpy(),
                               gguf_dequantize(v.raw.numpy(), T.Q8_0), rtol=1e-6)
