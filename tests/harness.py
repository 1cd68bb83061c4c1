"""In-process engine for tests: the scheduler policy and the model runner joined without sockets."""

from __future__ import annotations

import time

import numpy as np
import torch

from services.executor.attention import select_backend
from services.executor.runner import ModelRunner, allocate_kv_cache
from services.executor.weights import build_model
from services.scheduler.block_manager import BlockManager
from services.scheduler.contiguous import ContiguousBlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.messages import AddRequest, SamplingParams, decode, encode


def tiny_llama(seed: int = 0, **overrides):
    """A small random Hugging Face Llama (2 layers, grouped-query attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(
        vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**kwargs)).eval()


class InProcessEngine:
    """Scheduler + ModelRunner, with every message round-tripped through the wire codec."""

    def __init__(self, hf_model, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 backend: str = "torch", dtype=torch.float32, preemption_mode: str = "recompute",
                 kv_policy: str = "paged", num_cpu_blocks: int = 0, enable_prefix_caching: bool = True):
        cfg = hf_model.config
        max_model_len = max_model_len or cfg.max_position_embeddings
        device = torch.device("cpu")
        model = build_model(cfg, hf_model.state_dict(), dtype, device, max_model_len)
        from services.executor.model import ModelConfig

        mcfg = ModelConfig.from_hf(cfg)
        self.runner = ModelRunner(model, allocate_kv_cache(mcfg, num_blocks, block_size, dtype, device),
                                  select_backend(backend, device), device,
                                  cpu_kv_caches=allocate_kv_cache(mcfg, num_cpu_blocks, block_size, dtype, device))
        manager = ContiguousBlockManager if kv_policy == "contiguous" else BlockManager
        self.blocks = manager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                              enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, preemption_mode, kv_policy),
            self.blocks,
        )
        self.outputs: dict[str, list] = {}  # request id -> every RequestOutput received
        self.num_steps = 0
        self.max_tokens_in_step = 0
        self.mixed_steps = 0  # steps that held both decodes and prefills

    def add(self, request_id: str, prompt: list[int], eos: list[int] = (), **sampling) -> list:
        req = AddRequest(request_id, np.array(prompt, np.int32), SamplingParams(**sampling), list(eos), time.time())
        return self.scheduler.add_request(decode(encode(req)))

    def step(self) -> list:
        step = self.scheduler.schedule()
        early = self.scheduler.take_outputs()
        for out in early:
            self.outputs.setdefault(out.request_id, []).append(out)
        if step is None:
            return early
        step = decode(encode(step))
        self.num_steps += 1
        self.max_tokens_in_step = max(self.max_tokens_in_step, len(step.input_token_ids))
        if 0 < step.num_decodes < len(step.seq_ids):
            self.mixed_steps += 1
        result = decode(encode(self.runner.execute(step)))
        outs = self.scheduler.update(result)
        self.blocks.check_integrity()
        for out in outs:
            self.outputs.setdefault(out.request_id, []).append(out)
        return early + outs

    def run(self) -> dict[str, list[int]]:
        """Step until all requests finish; returns the generated tokens per request."""
        tokens: dict[str, list[int]] = {}
        while self.scheduler.has_work():
            for out in self.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens
