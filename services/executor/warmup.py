"""A warm-up before the executor says it is ready: a short prefill and a decode of two throw-away
sequences through ``ModelRunner.execute``, so that the first real request does not pay for loading
the Numba kernels from their cache (or compiling them), oneDNN's first primitives and torch's first
allocations. Then the paths those steps do not reach: the per-layer ops at a long prefill chunk's
row count (``warm_layer_ops``) and the backend's own (its ``warm_up``, where it has one: the numba
backend's partitioned decode and block copy).

Measured on SmolLM2 in bfloat16 (2-core AMD EPYC, ``python -m loadtest.bench.throughput``): the first
step of a fresh server took about 300 ms for an 18-token prompt (2.5 s when the Numba cache was
cold), where a warm one takes about 20 ms; every request of that first batch waited for it. With
only the two steps, a server on a cold Numba cache (a fresh install, a new container) still took
4.1 s for its first 2,048-token prefill chunk instead of about 0.7 s: the norm, rotary and
activation kernels run in parallel from 1,024, 512 and 256 rows, and compiling those three
variants took 0.6, 1.3 and 0.7 s (0.5-6 ms each from a warm cache); the partitioned decode kernel
(contexts over 4,096 tokens at small batches) took 3.3 s.

The sequences use negative ids (the scheduler's are never negative) and the pool's first blocks;
nothing the scheduler owns exists yet, every block is written by its next owner before it is
read, and the last step frees both sequences, so the runner is left as it was. Sampling is greedy:
no random generator moves. Every rank of a tensor-parallel group runs the same steps, so their
collectives pair up as in any step.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.messages import NewSequence, SamplingParams, Step

from .decoder import DecoderForCausalLM

WARMUP_SEQ_IDS = (-1, -2)  # never a scheduler's (its ids count up from 0)
WARMUP_PROMPT_LENS = (96, 16)  # tokens: a prefill long enough for the attention kernel's parallel path
# rows of warm_layer_ops: from this many the numba backend runs every per-layer op in parallel
# (PARALLEL_FROM_ROWS of kernels/cpu/norm.py, rotary.py and activation.py: 1,024, 512, 256)
WARMUP_ROWS = 1024


def warmup_steps(block_size: int, num_blocks: int, max_model_len: int, vocab_size: int) -> list[Step]:
    """Three steps: prefill both sequences, decode both, free both (empty when the pool or the
    model length is too small for them)."""
    lens = [min(n, max_model_len - 1) for n in WARMUP_PROMPT_LENS]
    blocks_per_seq = [-(-(n + 1) // block_size) for n in lens]
    if min(lens) < 1 or sum(blocks_per_seq) > num_blocks:
        return []
    prompts = [((np.arange(n) * 7 + 1) % vocab_size).astype(np.int32) for n in lens]
    first = np.cumsum([0] + blocks_per_seq)
    tables = np.zeros((2, max(blocks_per_seq)), np.int32)
    for i, count in enumerate(blocks_per_seq):
        tables[i, :count] = np.arange(first[i], first[i] + count)

    def slots(i: int, positions: np.ndarray) -> np.ndarray:
        return tables[i][positions // block_size].astype(np.int64) * block_size + positions % block_size

    ids = np.array(WARMUP_SEQ_IDS, np.int64)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    new = [NewSequence(int(s), f"warmup-{-s}", greedy, p, len(p)) for s, p in zip(ids, prompts)]
    pos = [np.arange(n, dtype=np.int64) for n in lens]
    prefill = Step(
        step_id=-1, num_decodes=0, seq_ids=ids, input_token_ids=np.concatenate(prompts).astype(np.int64),
        positions=np.concatenate(pos), slot_mapping=np.concatenate([slots(i, p) for i, p in enumerate(pos)]),
        query_start_loc=np.array([0, lens[0], lens[0] + lens[1]], np.int32),
        context_lens=np.array(lens, np.int32), block_tables=tables, sample_mask=np.ones(2, bool), new_seqs=new)
    last = np.array(lens, np.int64)
    decode = Step(
        step_id=-2, num_decodes=2, seq_ids=ids, input_token_ids=np.array([p[-1] for p in prompts], np.int64),
        positions=last, slot_mapping=np.concatenate([slots(i, last[i:i + 1]) for i in range(2)]),
        query_start_loc=np.array([0, 1, 2], np.int32), context_lens=(last + 1).astype(np.int32),
        block_tables=tables, sample_mask=np.ones(2, bool))
    empty = np.zeros(0, np.int64)
    free = Step(step_id=-3, num_decodes=0, seq_ids=empty, input_token_ids=empty, positions=empty,
                slot_mapping=empty, query_start_loc=np.zeros(1, np.int32), context_lens=np.zeros(0, np.int32),
                block_tables=np.zeros((0, tables.shape[1]), np.int32), sample_mask=np.zeros(0, bool),
                finished_seq_ids=[int(s) for s in ids])
    return [prefill, decode, free]


@torch.inference_mode()
def warm_layer_ops(model, backend, rows: int = WARMUP_ROWS) -> None:
    """The first decoder layer's residual add + norm, rotary embedding and (where the model uses
    it) fused activation, each once on ``rows`` rows of zeros: the row counts of a long prompt's
    chunk, at which a backend may take other kernels than at the warm-up prefill's. Writes only
    the scratch tensors made here; the model's weights and caches are not touched. Llama-family
    models only: OPT's layers run torch's ops, which take no other path at these rows."""
    if not isinstance(model, DecoderForCausalLM):
        return
    layer = model.model.layers[0]
    attn, mlp, weight = layer.self_attn, layer.mlp, layer.input_layernorm.weight

    def zeros(width: int) -> torch.Tensor:
        return torch.zeros(rows, width, dtype=weight.dtype, device=weight.device)

    layer.input_layernorm(zeros(weight.shape[0]), zeros(weight.shape[0]), backend)
    cos, sin = model.rotary.at(torch.zeros(rows, dtype=torch.int64, device=weight.device), weight.dtype)
    qkv = zeros((attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim)
    model.rotary(qkv, cos, sin, attn.num_heads, attn.num_kv_heads, backend)
    if not mlp.as_transformers(weight.dtype):
        mlp.activation(zeros(2 * mlp.num_columns), backend)


def warm_up(runner) -> int:
    """Run the warm-up steps on ``runner``, then ``warm_layer_ops`` and the backend's ``warm_up``
    (with the first layer's pools; before any block holds a sequence's data); returns how many
    steps ran."""
    steps = warmup_steps(runner.block_size, runner.num_blocks, runner.max_model_len,
                         runner.model.config.vocab_size)
    for step in steps:
        runner.execute(step)
    warm_layer_ops(runner.model, runner.backend)
    backend_warm_up = getattr(runner.backend, "warm_up", None)
    if backend_warm_up is not None and runner.kv_caches:
        backend_warm_up(*runner.kv_caches[0], runner.model.plan.num_local_heads, runner.max_model_len)
    return len(steps)
