"""Tiny random models of every family the executor builds, from transformers' own config classes:
grouped-query heads, a sliding window smaller than the test prompts where the family has one,
Gemma 2's soft-capping small enough to bite, and random norm weights (transformers starts them at
one, or at zero for Gemma's ``1 + weight``), so that every knob changes the output."""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)

# family -> (transformers config class, model class, the family's own settings)
FAMILY_SPECS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=9, pad_token_id=0, bos_token_id=1,
                                                    eos_token_id=2, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=7, tie_word_embeddings=False)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=6, query_pre_attn_scalar=24, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=6, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}
WINDOWED = ("phi3", "mistral", "gemma2", "gemma3_text")


def tiny_family(name: str, seed: int = 0, **overrides):
    """A small random Hugging Face model of family ``name`` (``FAMILY_SPECS``), float32, eval mode,
    with eager attention (transformers' plainest form of the soft-capping and window masks)."""
    import transformers

    config_name, model_name, own = FAMILY_SPECS[name]
    config = getattr(transformers, config_name)(**{**COMMON, **own, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.2)
    return model


def random_prompts(lengths, seed: int = 0, vocab_size: int = 128) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def engine_greedy(model, prompts: list[list[int]], max_tokens: int, **engine) -> list[list[int]]:
    """Our engine's greedy tokens for each prompt (EOS ignored), all in one batch; ``engine``:
    ``InProcessEngine``'s options (small pools, 16-token steps: long prompts prefill in chunks)."""
    from tests.doubles.engine import InProcessEngine

    run = InProcessEngine(model, **{"num_blocks": 96, "block_size": 4, "max_num_batched_tokens": 16, **engine})
    for i, prompt in enumerate(prompts):
        run.add(f"r{i}", prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    got = run.run()
    return [got[f"r{i}"] for i in range(len(prompts))]


def engine_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """Our engine's logprob of each prompt token after the first (8-token prefill chunks)."""
    from tests.doubles.engine import InProcessEngine

    run = InProcessEngine(model, num_blocks=64, block_size=4, max_num_batched_tokens=8)
    run.add("s", prompt, temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    run.run()
    return torch.tensor(next(o for o in run.outputs["s"] if o.prompt_logprobs).prompt_logprobs)


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """transformers' logprob of each prompt token after the first (the reference)."""
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]
    return ref.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
