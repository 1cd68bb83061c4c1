"""Every model family against transformers, in float32: greedy output token for token on prompts
longer than the sliding window, prompt logprobs within 1e-4, and the model each family's file
reads (the knobs that make it differ from Llama)."""

from __future__ import annotations

import pytest
import torch

from services.executor.architectures import FAMILIES, model_class, model_config
from services.executor.rope import plain_rope
from tests.doubles.engine import InProcessEngine, hf_greedy
from tests.doubles.families import (FAMILY_SPECS, WINDOWED, engine_greedy, engine_prompt_logprobs,
                                    hf_prompt_logprobs, random_prompts, tiny_family)

TOLERANCE = 1e-4
LENGTHS = (3, 11, 17, 26)  # all but the first longer than every tiny window


@pytest.fixture(scope="module", params=sorted(FAMILY_SPECS))
def family_model(request):
    return request.param, tiny_family(request.param, seed=11)


def test_every_family_is_registered():
    assert set(FAMILY_SPECS) <= set(FAMILIES)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_greedy_equals_transformers(family_model, backend):
    name, model = family_model
    prompts = random_prompts(LENGTHS, seed=1)
    got = engine_greedy(model, prompts, 14, backend=backend)  # 16-token steps: long prompts in chunks
    for i, prompt in enumerate(prompts):
        assert got[i] == hf_greedy(model, prompt, 14), f"{name}: prompt {i} of {len(prompt)} tokens"


def test_prompt_logprobs_equal_transformers(family_model):
    name, model = family_model
    prompt = random_prompts([23], seed=2)[0]
    torch.testing.assert_close(engine_prompt_logprobs(model, prompt), hf_prompt_logprobs(model, prompt),
                               atol=TOLERANCE, rtol=0)


def test_each_family_reads_its_differences():
    cfg = {name: model_config(tiny_family(name).config) for name in FAMILY_SPECS}
    assert cfg["qwen3"].qk_norm and not cfg["qwen3"].layer_windows
    assert cfg["phi3"].layer_windows == (9, 9) and cfg["mistral"].layer_windows == (7, 7)
    assert cfg["mistral"].uniform_window == 7
    g2 = cfg["gemma2"]
    assert (g2.layer_windows, g2.uniform_window) == ((6, 0), 0)  # alternating: no block can be freed
    assert (g2.attn_softcap, g2.final_softcap, g2.query_scale) == (1.5, 2.0, 24**-0.5)
    assert g2.sandwich_norms and g2.hidden_act == "gelu_pytorch_tanh" and g2.embedding_scale == 96**0.5
    g3 = cfg["gemma3_text"]
    assert g3.qk_norm and (g3.rope, g3.local_rope) == (plain_rope(16, 1e6, 2.0), plain_rope(16, 1e4))
    for name in FAMILY_SPECS:
        assert model_class(tiny_family(name).config).__name__ == "DecoderForCausalLM"


def test_windowed_families_are_the_ones_with_windows():
    for name in FAMILY_SPECS:
        assert bool(model_config(tiny_family(name).config).layer_windows) == (name in WINDOWED)


@pytest.mark.parametrize("name,overrides,match", [
    ("mistral", dict(sliding_window=512), "sliding_window 512 is larger than the context"),
    ("phi3", dict(partial_rotary_factor=0.1), "partial_rotary_factor 0.1 must give an even share of head_dim 16"),
    ("qwen3", dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}),
     "rope type 'dynamic' is not supported"),
])
def test_unsupported_settings_are_one_line_errors(name, overrides, match):
    with pytest.raises(ValueError, match=match):
        model_config(tiny_family(name, **overrides).config)


def _saved(tmp_path, name: str, model):
    directory = tmp_path / name
    model.save_pretrained(directory)
    return directory


def _edit_weights(directory, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    state = load_file(path)
    edit(state)
    save_file(state, path)


@pytest.mark.slow  # starts four executor processes
def test_bad_checkpoints_exit_2_with_one_line_each(tmp_path):
    """As a user starts them: an unknown model type, a missing tensor, a misshapen one (named) and
    a window larger than the context each end the executor with code 2 and one line, no traceback."""
    import json

    from tests.executor.test_memory_plan import _run_cli

    cases = {}
    unknown = _saved(tmp_path, "unknown", tiny_family("qwen3"))
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox", "architectures": []}))
    cases["unknown"] = (unknown, "model type 'gpt_neox' is not supported (supported: llama, mistral")
    missing = _saved(tmp_path, "missing", tiny_family("qwen3"))
    _edit_weights(missing, lambda state: state.pop("model.layers.1.mlp.down_proj.weight"))
    cases["missing"] = (missing, "missing ['model.layers.1.mlp.down_proj.weight']")
    misshapen = _saved(tmp_path, "misshapen", tiny_family("qwen3"))
    _edit_weights(misshapen, lambda state: state.update({"model.layers.0.self_attn.k_proj.weight":
                                                         state["model.layers.0.self_attn.k_proj.weight"][:24]}))
    cases["misshapen"] = (misshapen, "weight model.layers.0.self_attn.qkv_proj.weight (joined from "
                                     "self_attn.q_proj, self_attn.k_proj, self_attn.v_proj) has shape (152, 96)")
    window = _saved(tmp_path, "window", tiny_family("mistral"))
    config = json.loads((window / "config.json").read_text())
    (window / "config.json").write_text(json.dumps({**config, "sliding_window": 512}))
    cases["window"] = (window, "sliding_window 512 is larger than the context (max_position_embeddings 256)")
    endpoints = ["--step-endpoint", f"ipc://{tmp_path}/step", "--result-endpoint", f"ipc://{tmp_path}/result"]
    runs = {case: _run_cli(tmp_path, "executor", "--model", str(directory), "--dtype", "float32", *endpoints)
            for case, (directory, _) in cases.items()}
    for case, proc in runs.items():
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (case, stderr[-2000:])
        assert "Traceback" not in stderr, (case, stderr[-2000:])
        last = stderr.strip().splitlines()[-1]
        assert cases[case][1] in last, (case, last)


@pytest.mark.slow  # two or three ranks per family
@pytest.mark.parametrize("name,world_size", [(name, 2) for name in sorted(FAMILY_SPECS)]
                         + [("gemma2", 3), ("phi3", 3), ("qwen3", 3)])
def test_ranks_equal_one(name, world_size):
    """``-tp 2`` (and ``-tp 3``, with 3 KV heads) computes what one rank does (logits within 1e-5,
    the same greedy tokens), through prefix hits, copy-on-write and swap; Phi-3's fused checkpoint
    weights are cut by heads too."""
    from tests.executor.test_tensor_parallel_model import check_sharded_equals_unsharded

    prompts = random_prompts((3, 11, 17, 9), seed=4)
    prompts.append(prompts[2][:12] + [5])  # shares the first blocks of another prompt
    heads = {} if world_size == 2 else dict(num_key_value_heads=3)
    check_sharded_equals_unsharded(tiny_family(name, seed=5, **heads), world_size, prompts, max_tokens=12,
                                   num_blocks=40, max_num_batched_tokens=16, preemption_mode="swap")


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_window_frees_blocks_and_output_stays_transformers(backend):
    """Mistral with window 7 in 4-token blocks, generating far past the window: the engine frees each
    block once no layer can attend to it (a decoding sequence holds at most ceil((W + bs - 1) / bs)
    blocks), the freed entries reach the kernels as block 0 and are never read, and greedy output
    stays transformers'; the Gemma 2 model (global layers too) keeps every block."""
    model = tiny_family("mistral", seed=12)
    prompts = random_prompts((26, 13), seed=6)
    engine = InProcessEngine(model, num_blocks=24, block_size=4, max_num_batched_tokens=16, backend=backend)
    assert engine.blocks.sliding_window == 7
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, temperature=0.0, max_tokens=70, ignore_eos=True)
    got, most = {}, 0
    while engine.has_work():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        for table in engine.blocks.block_tables.values():
            most = max(most, sum(b >= 0 for b in table))
    assert most <= -(-(7 + 4 - 1) // 4) + 4  # the window's blocks, plus a prefill chunk's
    for i, prompt in enumerate(prompts):  # 96 and 83 tokens: 45 blocks without freeing, of 24
        assert got[f"r{i}"] == hf_greedy(model, prompt, 70)
    assert InProcessEngine(tiny_family("gemma2"), num_blocks=24, block_size=4).blocks.sliding_window == 0


@pytest.mark.parametrize("name", ["mistral", "gemma2", "qwen3"])
def test_beam_search_equals_transformers(name):
    """Beams fork and share blocks (and, under Mistral's window, drop them as they leave it): the
    engine's beams are transformers' ``generate(num_beams=3)``."""
    from tests.offline.test_beam_search import first_greedy_token_at, hf_beams

    model = tiny_family(name, seed=21)
    prompt = random_prompts([11], seed=8)[0]
    eos = first_greedy_token_at(model, prompt, 5)
    expected = hf_beams(model, prompt, 3, 12, eos, 1.0, False)
    engine = InProcessEngine(model, num_blocks=64, block_size=4)
    engine.add("r", prompt, eos=[eos], n=3, use_beam_search=True, max_tokens=12, temperature=0.0,
               length_penalty=1.0, early_stopping=False)
    engine.run()
    got = {o.choice_idx: o.new_token_ids for o in engine.outputs["r"]}
    assert [got[i] for i in range(len(got))] == expected
    assert engine.blocks.num_used_blocks == 0
