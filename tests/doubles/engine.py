"""Test helpers: a tiny random Hugging Face Llama, SmolLM2's greedy reference from ``transformers``,
and the product's offline ``EngineCore`` over a model with every message round-tripped through the
wire codec and the block manager checked each step."""

from __future__ import annotations

import time

import numpy as np
import torch

from services.executor.loader import RunnerOptions, build_runner
from services.offline import EngineCore, SchedulingOptions
from shared.messages import AddRequest, RequestOutput, SamplingParams, Step, StepResult, decode, encode


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


def smollm2_greedy_reference(prompts: list[str], max_new_tokens: int, dtype: torch.dtype = torch.float32):
    """SmolLM2 (the embedded default model) in ``transformers`` at ``dtype`` and its greedy
    continuation of each prompt, exactly ``max_new_tokens`` long (EOS ignored):
    ``(tokenizer, model, prompt ids, reference ids)``. The weights are loaded in float32, then cast."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.model_source import resolve_model

    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.directory, **src.pretrained_kwargs())
    model = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32, **src.pretrained_kwargs())
    model = model.to(dtype).eval()
    prompt_ids = [tok(p)["input_ids"] for p in prompts]
    refs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None)
        refs.append(out[0, len(ids):].tolist())
        assert len(refs[-1]) == max_new_tokens
    return tok, model, prompt_ids, refs


class InProcessEngine(EngineCore):
    """``EngineCore`` with small-pool defaults, the codec in the loop, and a record of every output."""

    def __init__(self, hf_model, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 backend: str = "torch", dtype=torch.float32, preemption_mode: str = "recompute",
                 kv_policy: str = "paged", num_cpu_blocks: int = 0, enable_prefix_caching: bool = True,
                 async_scheduling: bool = False, speculative_config: str | None = None,
                 kv_cache_dtype: str = "auto"):
        runner = build_runner(hf_model.config, hf_model.state_dict(), RunnerOptions(
            dtype=dtype, block_size=block_size, num_kv_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks,
            max_model_len=max_model_len, attention_backend=backend, kv_cache_dtype=kv_cache_dtype,
        ))
        super().__init__(runner, SchedulingOptions(max_num_seqs, max_num_batched_tokens, preemption_mode, kv_policy,
                                                   enable_prefix_caching, async_scheduling,
                                                   speculative_config=speculative_config))
        self.outputs: dict[str, list[RequestOutput]] = {}  # request id -> every RequestOutput received
        self.num_steps = 0
        self.max_tokens_in_step = 0
        self.mixed_steps = 0  # steps that held both decodes and prefills

    def add(self, request_id: str, prompt: list[int], eos: list[int] = (), **sampling) -> list[RequestOutput]:
        """Queue a request; returns what the scheduler answered at once (an error, or nothing)."""
        params = SamplingParams(**{"eos_token_ids": list(eos), **sampling})
        req = AddRequest(request_id, np.array(prompt, np.int32), params, time.time())
        self.add_request(decode(encode(req)))
        return [decode(encode(out)) for out in self.scheduler.take_outputs()]

    def step(self) -> list[RequestOutput]:
        outs = [decode(encode(out)) for out in super().step()]
        self.blocks.check_integrity()
        for out in outs:
            self.outputs.setdefault(out.request_id, []).append(out)
        return outs

    def execute(self, step: Step) -> StepResult:
        step = decode(encode(step))
        self.num_steps += 1
        self.max_tokens_in_step = max(self.max_tokens_in_step, len(step.input_token_ids))
        if 0 < step.num_decodes < len(step.seq_ids):
            self.mixed_steps += 1
        return decode(encode(super().execute(step)))

    def run(self) -> dict[str, list[int]]:
        """Step until all requests finish; returns the generated tokens per request."""
        tokens: dict[str, list[int]] = {}
        while self.has_work():
            for out in self.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    assert len(new) == max_new_tokens
    return new
