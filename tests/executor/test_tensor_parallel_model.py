"""Sharded models (N ranks over the shared-memory all-reduce) compute the unsharded model's logits.

The steps come from the real scheduler driving the unsharded model (``InProcessEngine``): mixed
prefill and decode, chunked prefills, prefix-cache hits, a forked ``n > 1`` request (copy-on-write
block copies) and preemptions by swap. Each rank process replays them on its shard and its own
KV pool (only its KV heads); rank 0's logits must equal the unsharded replay's within float32
tolerance, with the same greedy tokens the engine sampled.

``replay`` drives the model as the runner does, without processes or sockets; the served path
(``serve -tp N``) is tested in ``test_server_tensor_parallel.py``.
"""

import os
import tempfile

import pytest
import torch

from services.executor.attention import AttentionMetadata, select_backend
from services.executor.architectures import model_config
from services.executor.parallel.sharding import ShardPlan, shard_state_dict
from services.executor.runner import allocate_kv_cache, kv_block_bytes
from services.executor.weights import build_model
from tests.doubles.engine import InProcessEngine, tiny_llama
from tests.doubles.rank_group import RankGroup, group_segments, make_communicator, new_group_id

BLOCK_SIZE, NUM_BLOCKS, NUM_CPU_BLOCKS = 4, 40, 40


def record_steps(hf_model, prompts, max_tokens, **engine_kwargs):
    """Run the unsharded engine; returns the steps it executed (as the executors received them)."""
    engine = InProcessEngine(hf_model, block_size=BLOCK_SIZE, backend="torch", **engine_kwargs)
    steps, execute = [], engine.runner.execute
    engine.runner.execute = lambda step: (steps.append(step), execute(step))[1]
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=2 if i == 1 else 1)
    engine.run()
    return steps


def replay(model, backend, steps, num_blocks, num_cpu_blocks):
    """Run ``steps`` on ``model`` over a fresh KV pool; rank 0 gets each step's logits (else None)."""
    cfg = model.kv_cache_config
    kv = allocate_kv_cache(cfg, num_blocks, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    cpu_kv = allocate_kv_cache(cfg, num_cpu_blocks, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    outs = []
    for step in steps:
        for pairs, dst_pool, src_pool in ((step.swap_out, cpu_kv, kv), (step.swap_in, kv, cpu_kv)):
            for (dk, dv), (sk, sv) in zip(dst_pool, src_pool) if len(pairs) else ():
                backend.swap_blocks(dk, sk, torch.from_numpy(pairs))
                backend.swap_blocks(dv, sv, torch.from_numpy(pairs))
        if len(step.block_copies):
            backend.copy_blocks([k for k, _ in kv], [v for _, v in kv], torch.from_numpy(step.block_copies))
        if not step.sample_mask.any():
            outs.append(None)  # no step of these runs is without a sample; kept for safety
            continue
        qsl = torch.from_numpy(step.query_start_loc)
        nd = step.num_decodes
        meta = AttentionMetadata(nd, int(qsl[nd]), torch.from_numpy(step.slot_mapping),
                                 torch.from_numpy(step.block_tables), torch.from_numpy(step.context_lens), qsl,
                                 qsl[nd:] - qsl[nd])
        hidden = model(torch.from_numpy(step.input_token_ids), torch.from_numpy(step.positions), kv, meta, backend)
        rows = torch.from_numpy(step.query_start_loc[1:][step.sample_mask] - 1).long()
        outs.append(model.compute_logits(hidden[rows]))
    return outs, kv


def _rank_worker(rank, world_size, report, spec, hf_model, steps, reference, num_blocks, backend):
    comm = make_communicator("shm", rank, world_size, spec)
    cfg = model_config(hf_model.config)
    plan = ShardPlan.for_model(cfg, rank, world_size)
    model = build_model(hf_model.config, hf_model.state_dict(), torch.float32, torch.device("cpu"),
                        hf_model.config.max_position_embeddings, plan, comm)
    outs, kv = replay(model, select_backend(backend, torch.device("cpu")), steps, num_blocks, NUM_CPU_BLOCKS)
    block_bytes = kv_block_bytes(model.kv_cache_config, BLOCK_SIZE, torch.float32)
    report({"kv_heads": kv[0][0].shape[1], "block_bytes": block_bytes, "num_logits": sum(o is not None for o in outs)})
    if rank == 0:
        max_err = max((o - r).abs().max().item() for o, r in zip(outs, reference) if r is not None)
        same_tokens = all(torch.equal(o.argmax(-1), r.argmax(-1)) for o, r in zip(outs, reference) if r is not None)
        report({"max_err": max_err, "same_tokens": same_tokens})
    comm.close()


def check_sharded_equals_unsharded(hf_model, world_size, prompts, max_tokens, atol=1e-5, backend="torch",
                                   method="fork", **engine_kwargs):
    """Record the unsharded engine's steps, replay them unsharded and on ``world_size`` ranks, compare."""
    num_blocks = engine_kwargs.setdefault("num_blocks", NUM_BLOCKS)
    steps = record_steps(hf_model, prompts, max_tokens, num_cpu_blocks=NUM_CPU_BLOCKS, **engine_kwargs)
    full = build_model(hf_model.config, hf_model.state_dict(), torch.float32, torch.device("cpu"),
                       hf_model.config.max_position_embeddings)
    reference, _ = replay(full, select_backend(backend, torch.device("cpu")), steps, num_blocks, NUM_CPU_BLOCKS)
    group_id = new_group_id()
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"group_id": group_id, "store_path": os.path.join(tmp, "store")}
        group = RankGroup(_rank_worker, world_size, spec, hf_model, steps, reference, num_blocks, backend,
                          method=method)
        assert group.join(600) == [0] * world_size, group.messages
    assert group_segments(group_id) == []
    cfg = model_config(hf_model.config)
    full_bytes = kv_block_bytes(cfg, BLOCK_SIZE, torch.float32)
    num_local_kv = max(1, cfg.num_kv_heads // world_size)
    for rank in range(world_size):
        info = group.wait_for(rank, "kv_heads")
        assert info["kv_heads"] == num_local_kv  # each rank's pool holds only its KV heads
        assert info["block_bytes"] * cfg.num_kv_heads == full_bytes * num_local_kv
        assert info["num_logits"] == (sum(r is not None for r in reference) if rank == 0 else 0)
    result = group.wait_for(0, "max_err")
    assert result["same_tokens"], "a greedy token differs from the unsharded model's"
    assert result["max_err"] < atol, f"logits differ by {result['max_err']}"
    return steps


def _prompts(vocab_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab_size, (9,), generator=gen).tolist()  # two prompts share 2 blocks
    lengths = [3, 5, 14, 1, 21]
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
    return prompts + [shared + [1, 2], shared + [3]]


@pytest.mark.parametrize("world_size,num_heads,num_kv_heads", [
    (2, 6, 2),  # 3 query heads and 1 KV head per rank
    pytest.param(3, 6, 3, marks=pytest.mark.slow),  # vocabulary 128 in shards of 43 (padded), intermediate 42/43/43
    (2, 4, 2),
    pytest.param(4, 4, 2, marks=pytest.mark.slow),  # 1 KV head replicated on 2 ranks each
])
def test_tiny_gqa_sharded_equals_unsharded(world_size, num_heads, num_kv_heads):
    hf_model = tiny_llama(seed=3, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                          hidden_size=16 * num_heads)
    steps = check_sharded_equals_unsharded(hf_model, world_size, _prompts(128), max_tokens=16, num_blocks=16,
                                           max_num_batched_tokens=24, preemption_mode="swap")
    assert any(0 < s.num_decodes < len(s.seq_ids) for s in steps), "prefill and decode never shared a step"
    assert any(len(s.block_copies) for s in steps), "no copy-on-write copy happened"
    assert any(len(s.swap_out) for s in steps) and any(len(s.swap_in) for s in steps), "no swap happened"


@pytest.mark.slow  # spawned ranks compile the kernels again
def test_numba_kernels_on_shards():
    """The Numba CPU kernels with a rank's head counts (3 query heads on 1 KV head)."""
    pytest.importorskip("kernels.cpu")
    hf_model = tiny_llama(seed=6)
    check_sharded_equals_unsharded(hf_model, 2, _prompts(128, seed=2), max_tokens=8, num_blocks=64,
                                   backend="numba", method="spawn")  # numba's OpenMP pool does not survive fork


def test_tied_embeddings_sharded_equals_unsharded():
    hf_model = tiny_llama(seed=4, tie_word_embeddings=True, num_key_value_heads=3)
    check_sharded_equals_unsharded(hf_model, 3, _prompts(128, seed=1), max_tokens=6, num_blocks=128)


@pytest.mark.parametrize("world_size,num_heads,num_kv_heads,match", [
    (4, 6, 2, "must divide the number of attention heads"),
    (3, 6, 2, "one must divide the other"),
    (5, 5, 5, None),
])
def test_shard_plan_rules(world_size, num_heads, num_kv_heads, match):
    def plan(rank):
        return ShardPlan(rank, world_size, num_heads, num_kv_heads, 16, 100, 50)

    if match:
        with pytest.raises(ValueError, match=f"--tensor-parallel-size {world_size}.*{match}"):
            plan(0)
        return
    assert [plan(r).kv_head_start for r in range(world_size)] == list(range(world_size))


def test_kv_head_mapping_follows_vllm():
    # N > Hkv: rank r holds KV head r // (N / Hkv); N < Hkv: a contiguous block of Hkv / N heads.
    assert [ShardPlan(r, 4, 8, 2, 16, 64, 64).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    assert [ShardPlan(r, 8, 8, 2, 16, 64, 64).kv_head_start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [ShardPlan(r, 2, 8, 4, 16, 64, 64).kv_head_start for r in range(2)] == [0, 2]
    assert ShardPlan(1, 2, 8, 4, 16, 64, 64).num_local_kv_heads == 2


def test_shards_cover_the_full_weights():
    hf_model = tiny_llama(seed=5, num_key_value_heads=3)
    state = hf_model.state_dict()
    cfg = model_config(hf_model.config)
    shards = [shard_state_dict(state, ShardPlan.for_model(cfg, r, 3)) for r in range(3)]
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        assert torch.equal(torch.cat([s[name] for s in shards]), state[name])
    for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert torch.equal(torch.cat([s[name] for s in shards], dim=1), state[name])
    vocab = torch.cat([s["lm_head.weight"] for s in shards])
    assert vocab.shape[0] == 129 and torch.equal(vocab[:128], state["lm_head.weight"]) and not vocab[128:].any()
    assert torch.equal(shards[2]["model.norm.weight"], state["model.norm.weight"])


@pytest.mark.slow
def test_smollm2_tp3_equals_unsharded():
    """SmolLM2-135M: 9 attention heads and 3 KV heads, so -tp 3 gives each rank 3 and 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.model_source import resolve_model

    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.directory, **src.pretrained_kwargs())
    hf_model = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32, **src.pretrained_kwargs())
    hf_model.eval()
    prompts = [tok(p)["input_ids"] for p in ("The capital of France is", "def fibonacci(n):\n")]
    # 30 layers of float32 sums in another order: the logits (about 20 in size) moved by 7e-5
    check_sharded_equals_unsharded(hf_model, 3, prompts, max_tokens=12, atol=1e-3, num_blocks=64,
                                   max_model_len=256)
