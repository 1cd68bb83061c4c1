"""Run one ``Step``: apply block copies, forward the flat batch over the paged cache, sample.

The runner never picks a block: slots, block tables and copies arrive in the step. It keeps what
the executor knows of each live sequence (its sampling parameters, its token history, its last
sampled token for the next step's placeholder: ``placeholders``) from the step's ``new_seqs`` until
the step that lists it in ``finished_seq_ids``.

In a tensor-parallel group every rank runs every step (the same collectives in the same order);
only rank 0 gets the logits, samples and has tokens to return; the others return an empty result.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.messages import Step, StepResult

from .attention import AttentionMetadata
from .histories import TokenHistories
from .model import CausalLM
from .placeholders import SampledTokens
from .pooling import pool_rows
from .prompt_logprobs import score_prompts
from .sampler import Sampler
from .speculative import sample_with_drafts


def kv_block_bytes(cfg, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * elem


def allocate_kv_cache(cfg, num_blocks: int, block_size: int, dtype, device, zero: bool = True):
    """Per layer (key_cache, value_cache), each ``[num_blocks, num_kv_heads, block_size, head_dim]``.
    ``zero=False`` for a pool whose blocks are always written whole before they are read (the swap
    pool): left unwritten, its pages take no memory until blocks are swapped out."""
    shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
    new = torch.zeros if zero else torch.empty
    return [(new(shape, dtype=dtype, device=device), new(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches, backend, device: torch.device, seed: int = 0,
                 cpu_kv_caches=None, kv_cache_dtype: str = ""):
        self.model = model
        self.kv_caches = kv_caches
        self.cpu_kv_caches = cpu_kv_caches or []  # the swap pool, same layout
        # how the blocks store K/V: the model's dtype's name, or int8 / fp8_e4m3 (kv_cache.py)
        self.kv_cache_dtype = kv_cache_dtype or (str(kv_caches[0][0].dtype).removeprefix("torch.") if kv_caches else "")
        self.backend = backend
        self.device = device
        self.histories = TokenHistories()
        self.sampler = Sampler(seed, self.histories)
        self.sampled = SampledTokens()
        self.comm = model.comm  # the group's, through which the ranks agree on placeholders
        self.offload = None  # the KV offload tiers (``kv_offload.KvOffload``), set by the loader
        self._mover = None  # live migration's block files (``kv_migration.BlockMover``), made on first use
        self._migrate_failed: list[bytes] = []

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0][0].shape[0]  # [blocks, heads, slots, dim]

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_kv_caches[0][0].shape[0] if self.cpu_kv_caches else 0

    @property
    def block_size(self) -> int:
        return self.kv_caches[0][0].shape[2]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(getattr(t, "nbytes", 0) for pair in self.kv_caches for t in pair)  # QuantCache: with scales

    @property
    def max_model_len(self) -> int:
        """Positions the model was built for."""
        return self.model.max_model_len

    def forget_sequences(self) -> None:
        """Drop every sequence's sampling state and token history (a new scheduler knows none of
        them; it announces each again)."""
        self.sampler.clear()
        self.histories.clear()
        self.sampled.clear()

    def _move_blocks(self, step: Step) -> None:
        """The offload tiers' moves, swap out, then swap in, then copy-on-write copies: all before
        the forward pass."""
        if self.offload is not None and len(step.tier_ops):
            self.offload.apply(step, self.kv_caches, self.backend)
        if len(step.migrate_ops):  # after the tiers' copies out of reused blocks, before anything else
            self._migrate(step)
        if len(step.swap_out):
            mapping = torch.from_numpy(step.swap_out)
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_kv_caches):
                self.backend.swap_blocks(ck, k, mapping)
                self.backend.swap_blocks(cv, v, mapping)
        if len(step.swap_in):
            mapping = torch.from_numpy(step.swap_in)
            for (k, v), (ck, cv) in zip(self.kv_caches, self.cpu_kv_caches):
                self.backend.swap_blocks(k, ck, mapping)
                self.backend.swap_blocks(v, cv, mapping)
        if len(step.block_copies):
            self.backend.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches],
                        torch.from_numpy(step.block_copies))

    def _migrate(self, step: Step) -> None:
        if self._mover is None:
            from .kv_migration import BlockMover

            self._mover = BlockMover(self.kv_caches, self.comm, self.device)
        self._migrate_failed += self._mover.apply(step.migrate_ops, step.migrate_keys, step.migrate_dir)

    def execute(self, step: Step) -> StepResult:
        """Run ``step`` and return the sampled tokens (one per sequence with ``sample_mask``), and
        the offload tiers' news."""
        result = self._execute(step)
        result.migrate_failed, self._migrate_failed = self._migrate_failed, []
        return self.offload.report(result) if self.offload is not None else result

    def _execute(self, step: Step) -> StepResult:
        for seq_id in step.finished_seq_ids:
            self.sampler.remove(seq_id)
            self.histories.remove(seq_id)
            self.sampled.remove(seq_id)
        for new in step.new_seqs:
            self.sampler.add(new.seq_id, new.sampling)
            self.histories.add(new)
        self.sampled.fill(step, self.comm, self.device)  # before the histories see its tokens
        self.histories.observe(step)
        self._move_blocks(step)
        if len(step.seq_ids) == 0:
            return StepResult(step.step_id, step.seq_ids, step.seq_ids.copy())
        dev = self.device
        query_start_loc = torch.from_numpy(step.query_start_loc).to(dev)
        nd = step.num_decodes
        meta = AttentionMetadata(
            num_decodes=nd,
            num_decode_tokens=int(step.query_start_loc[nd]),
            slot_mapping=torch.from_numpy(step.slot_mapping).to(dev),
            block_tables=torch.from_numpy(step.block_tables).to(dev),
            context_lens=torch.from_numpy(step.context_lens).to(dev),
            query_start_loc=query_start_loc,
            prefill_query_start_loc=query_start_loc[nd:] - query_start_loc[nd],
        )
        hidden = self.model(
            torch.from_numpy(step.input_token_ids).to(dev),
            torch.from_numpy(step.positions).to(dev),
            self.kv_caches, meta, self.backend,
        )  # [T, hidden]
        prompt_scores = score_prompts(step, hidden, self.histories, self.model.compute_logits)
        prompt_scores.update(pool_rows(step, hidden) if self.comm.rank == 0 else {})
        if len(step.num_draft_tokens):  # speculative decoding: drafts to verify (``speculative``)
            fields = sample_with_drafts(self.sampler, self.model.compute_logits, step, hidden)
            if fields is None:  # another rank of a group
                return StepResult(step.step_id, step.seq_ids[:0], step.seq_ids[:0].copy())
            return StepResult(step.step_id, **fields, **prompt_scores)
        sample_rows = torch.from_numpy(step.query_start_loc[1:][step.sample_mask] - 1).long().to(dev)
        sampled_ids = step.seq_ids[step.sample_mask]
        if len(sampled_ids) == 0:
            return StepResult(step.step_id, sampled_ids, sampled_ids.copy(), **prompt_scores)
        logits = self.model.compute_logits(hidden[sample_rows])  # every rank gathers; rank 0 gets them
        if logits is None:  # another rank of a group: rank 0 samples and replies
            return StepResult(step.step_id, sampled_ids[:0], sampled_ids[:0].copy())
        out = self.sampler.sample(logits, sampled_ids.tolist())
        token_ids = out.token_ids.cpu().numpy().astype("int64")
        self.sampled.record(step, sampled_ids, token_ids)
        return StepResult(step.step_id, sampled_ids, token_ids,
                          logprobs=out.logprobs, top_token_ids=out.top_token_ids, top_logprobs=out.top_logprobs,
                          failed_seq_ids=np.asarray(list(out.failed), np.int64),
                          failure=next(iter(out.failed.values()), None), **prompt_scores)
