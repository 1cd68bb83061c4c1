"""Embedding throughput in the offline engine: prefill-only pooled requests against the same
prompts' prefill with one sampled token.

    python -m loadtest.bench.embeddings [--prompts 64] [--tokens 128] [--rounds 3] [--dtype auto]

SmolLM2-135M-Instruct (the embedded model) embeds ``--prompts`` random prompts of ``--tokens``
tokens each (``LLM.embed``, last-token and mean pooling), and generates one token for each of the
same prompts (``max_tokens`` 1: a prefill and one sample); the prefix cache is off so that every
round computes every token. Prints each kind's median seconds over ``--rounds`` and its prompt
tokens per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from loadtest.common.machine_state import print_cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    print_cpu()
    from services.offline import LLM
    from shared.messages import SamplingParams

    llm = LLM(dtype=args.dtype, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.tokens).tolist() for _ in range(args.prompts)]
    kinds = {
        "embed, last": lambda: llm.embed(prompts, pooling="last"),
        "embed, mean": lambda: llm.embed(prompts, pooling="mean"),
        "generate 1 token": lambda: llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
    }
    for run in kinds.values():
        run()  # warm-up: kernels compiled, threads tuned for these shapes
    num_tokens = args.prompts * args.tokens
    print(f"{args.prompts} prompts x {args.tokens} tokens, dtype {args.dtype}, {args.rounds} rounds")
    for name, run in kinds.items():
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        print(f"{name:18s} {median:7.2f} s  {num_tokens / median:9.0f} prompt tokens/s")


if __name__ == "__main__":
    main()
