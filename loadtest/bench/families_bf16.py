"""How closely each model family agrees with transformers in bfloat16 (in float32 the tests hold
them token-identical; in bfloat16 two correct engines round differently, so this is reported, not
asserted):

    python -m loadtest.bench.families_bf16 [--families llama,qwen3,...] [--prompts 8] [--tokens 32]

Per family, a small random model (transformers' own initialization, norms perturbed; windows of 32
where the family has them, so that the prompts pass them) in bfloat16, served by the offline
engine and run by transformers on the same weights:

- greedy agreement: the share of generated positions before each prompt's first difference;
- teacher-forced top-1 agreement: on transformers' own greedy continuation, the share of positions
  where our next-token argmax equals transformers';
- the largest difference of the prompt logprobs (nats).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from loadtest.common.machine_state import print_cpu
from shared.hub_kernels import hide_hub_kernels

SIZES = dict(vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)
WINDOW = 32
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=WINDOW, pad_token_id=0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=WINDOW, query_pre_attn_scalar=32,
                                                          pad_token_id=0)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=WINDOW, query_pre_attn_scalar=32,
                                                                  pad_token_id=0)),
}


def hf_model(name: str):
    hide_hub_kernels()
    import transformers

    config_name, model_name, own = FAMILIES[name]
    config = getattr(transformers, config_name)(**{**SIZES, **own})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.2)
    return model


def ours(model):
    from services.executor.loader import RunnerOptions, build_runner
    from services.offline import EngineCore

    runner = build_runner(model.config, model.state_dict(), RunnerOptions(dtype=torch.bfloat16, num_kv_blocks=512))
    return EngineCore(runner)


def run(engine, prompts: list[list[int]], tokens: int, prompt_logprobs: bool = False) -> dict[str, object]:
    from shared.messages import AddRequest, SamplingParams

    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                                prompt_logprobs=0 if prompt_logprobs else None)
        engine.add_request(AddRequest(f"r{i}", np.array(p, dtype=np.int32), params, 0.0))
    got: dict[str, object] = {}
    while engine.has_work():
        for out in engine.step():
            entry = got.setdefault(out.request_id, {"tokens": [], "logprobs": [], "ranks": []})
            entry["tokens"].extend(out.new_token_ids)
            if out.prompt_logprobs:
                entry["logprobs"], entry["ranks"] = out.prompt_logprobs, out.prompt_ranks
    return got


def measure(name: str, num_prompts: int, tokens: int) -> dict[str, float]:
    model = hf_model(name)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, SIZES["vocab_size"], (48 + 8 * i,), generator=gen).tolist() for i in range(num_prompts)]
    model = model.to(torch.bfloat16)
    engine = ours(model)
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
    got = run(engine, prompts, tokens)
    same = sum(next((j for j, (a, b) in enumerate(zip(got[f"r{i}"]["tokens"], w)) if a != b), tokens)
               for i, w in enumerate(want))
    # teacher forcing on transformers' continuation: is its greedy token our most likely one too?
    seqs = [p + w[:-1] for p, w in zip(prompts, want)]
    forced = run(engine, seqs, 1, prompt_logprobs=True)
    top1 = total = 0
    worst = 0.0
    for i, (p, seq) in enumerate(zip(prompts, seqs)):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)[:-1]
        want_lp = ref.gather(1, torch.tensor(seq[1:]).unsqueeze(1)).squeeze(1)
        worst = max(worst, float((torch.tensor(forced[f"r{i}"]["logprobs"]) - want_lp).abs().max()))
        ranks = forced[f"r{i}"]["ranks"][len(p) - 1:]  # the continuation's positions
        top1, total = top1 + sum(r == 1 for r in ranks), total + len(ranks)
    return {"greedy": same / (tokens * num_prompts), "forced_top1": top1 / max(total, 1), "max_logprob_diff": worst}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    print_cpu()
    print("| family | greedy agreement | teacher-forced top-1 | max prompt-logprob difference |")
    print("|---|---|---|---|")
    for name in args.families.split(","):
        r = measure(name, args.prompts, args.tokens)
        print(f"| {name} | {r['greedy']:.0%} | {r['forced_top1']:.0%} | {r['max_logprob_diff']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
