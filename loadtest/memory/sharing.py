"""KV blocks saved by sharing: parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6).

    python -m loadtest.memory.sharing [--num-requests 16] [--max-tokens 48]

Runs SmolLM2 in the offline engine (``services.offline.LLM``: scheduler and model runner in one
process) on short chat prompts like the paper's Alpaca run. At every step it records the blocks really in use, where the samples
or beams of a request point at the same physical blocks, and the blocks the same sequences would
hold without sharing (every block table counted in full), and prints the peak and mean of both
and the saving. The paper reports 6.1-9.8 % for parallel sampling and 37.6-55.2 % for beam search.
"""

from __future__ import annotations

import argparse
import statistics
import time

from loadtest.memory.paging import questions
from shared.hub_kernels import hide_hub_kernels


def run(model, tokenizer, prompts, max_tokens: int, **sampling) -> dict[str, float]:
    from services.offline import LLM
    from shared.messages import SamplingParams

    llm = LLM.from_hf_model(model, tokenizer, num_kv_blocks=4096, block_size=16, max_model_len=1024,
                            max_num_batched_tokens=512, enable_prefix_caching=False)
    for p in prompts:
        llm.add_request(p, SamplingParams(max_tokens=max_tokens, **sampling))
    engine = llm.engine
    shared, unshared = [], []
    while engine.has_work():
        engine.step()
        tables = engine.blocks.block_tables.values()
        if tables:
            shared.append(engine.blocks.num_used_blocks)
            unshared.append(sum(len(t) for t in tables))
    return {"peak": max(shared), "mean": statistics.mean(shared), "peak_unshared": max(unshared),
            "mean_unshared": statistics.mean(unshared)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    import torch
    hide_hub_kernels()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.model_source import resolve_model

    src = resolve_model(None)
    print("loading SmolLM2 ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(src.directory, **src.pretrained_kwargs())
    model = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32, **src.pretrained_kwargs())
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
               for q in questions(args.num_requests)]
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"up to {args.max_tokens} output tokens, block size 16", flush=True)
    rows = []
    for label, sampling in [(f"parallel n={n}", dict(n=n, temperature=1.0, seed=0)) for n in (2, 4, 6)] + \
                           [(f"beam width={k}", dict(n=k, use_beam_search=True, temperature=0.0)) for k in (2, 4, 6)]:
        t0 = time.monotonic()
        r = run(model, tokenizer, prompts, args.max_tokens, **sampling)
        rows.append((label, r))
        print(f"  {label}: done in {time.monotonic() - t0:.0f} s", flush=True)
    print(f"\n{'workload':18}{'peak blocks':>13}{'unshared':>10}{'mean blocks':>13}{'unshared':>10}{'saved (mean)':>14}")
    for label, r in rows:
        saved = 1 - r["mean"] / r["mean_unshared"]
        print(f"{label:18}{r['peak']:>13}{r['peak_unshared']:>10}{r['mean']:>13.1f}{r['mean_unshared']:>10.1f}"
              f"{saved:>14.1%}")


if __name__ == "__main__":
    main()
