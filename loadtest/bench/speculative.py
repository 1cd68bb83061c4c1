"""Speculative decoding (ngram prompt lookup) against plain decoding, on SmolLM2, in one run.

    python -m loadtest.bench.speculative [--max-tokens 96] [--k 4] [--dtype auto] [--rounds 1]

Two offline engines (``services.offline.LLM``) on the embedded SmolLM2-135M-Instruct, one with
``--speculative-config {"method": "ngram", ...}`` and one without, run the same greedy requests in
alternating order: one stream and 8 streams, on copy-heavy chats (repeat or lightly edit a given
text; complete code that repeats its own structure) and on open-ended ones. It prints output
tokens/s of each, their ratio, the acceptance rate (accepted / proposed drafts) and whether both
gave the same tokens. In-process: the engine's speed, no HTTP.
"""

from __future__ import annotations

import argparse
import json
import time

from shared.hub_kernels import hide_hub_kernels
from loadtest.common.machine_state import print_cpu

hide_hub_kernels()

TEXT = ("The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night its "
        "keeper climbed the narrow stairs, lit the great lamp and watched the ships pass safely through "
        "the dark water below. When the keeper grew old, the village decided to keep the light burning.")
CODE = ("def area_of_square(side):\n    return side * side\n\n\ndef area_of_rectangle(width, height):\n"
        "    return width * height\n\n\ndef perimeter_of_square(side):\n    return 4 * side\n\n\n"
        "def perimeter_of_rectangle(width, height):\n    return 2 * (width + height)\n\n\n")
COPY = [f"Repeat the following text exactly, word for word:\n\n{TEXT}",
        f"Rewrite this text, changing only 'lighthouse' to 'tower':\n\n{TEXT}",
        f"Here is a Python module:\n\n{CODE}Add docstrings to each function and show the whole module.",
        f"Copy this code and rename 'side' to 'length' everywhere:\n\n{CODE}"]
OPEN = ["Write a short story about a dragon who learns to bake bread.",
        "Explain why the sky is blue to a ten-year-old.",
        "Give me three ideas for a weekend trip in the mountains.",
        "What are the benefits of learning a second language?"]


def _llm(spec: str | None, dtype: str):
    from services.offline import LLM

    return LLM(dtype=dtype, speculative_config=spec, max_num_seqs=16)


def _run(llm, prompts: list[str], max_tokens: int) -> tuple[float, int, list[list[int]], tuple[int, int]]:
    from shared.messages import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    stats = llm.engine.scheduler.stats
    before = (sum(stats.spec_proposed), sum(stats.spec_accepted))
    start = time.perf_counter()
    outs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start
    tokens = [list(o.choices[0].token_ids) for o in outs]
    counts = (sum(stats.spec_proposed) - before[0], sum(stats.spec_accepted) - before[1])
    return elapsed, sum(len(t) for t in tokens), tokens, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    print_cpu()
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
                       "prompt_lookup_max": args.lookup_max})
    engines = {"plain": _llm(None, args.dtype), "ngram": _llm(spec, args.dtype)}
    print(f"SmolLM2-135M-Instruct, dtype {args.dtype}, greedy, max_tokens {args.max_tokens}, speculative {spec}")
    _run(engines["plain"], OPEN[:1], 8), _run(engines["ngram"], OPEN[:1], 8)  # warm-up (kernels compile)
    print(f"{'workload':<10} {'streams':>7} {'plain tok/s':>12} {'ngram tok/s':>12} {'ratio':>6} "
          f"{'accept':>7} {'same':>5}")
    for r in range(args.rounds):
        for name, prompts in (("copy", COPY), ("open", OPEN)):
            for streams in (1, 8):
                batch = [prompts[i % len(prompts)] for i in range(streams)] if streams > 1 else prompts[r % 2:r % 2 + 1]
                order = ("plain", "ngram") if r % 2 == 0 else ("ngram", "plain")
                res = {key: _run(engines[key], batch, args.max_tokens) for key in order}
                rate = {k: n / t for k, (t, n, _, _) in res.items()}
                proposed, accepted = res["ngram"][3]
                same = sum(a == b for a, b in zip(res["plain"][2], res["ngram"][2]))
                print(f"{name:<10} {streams:>7} {rate['plain']:>12.1f} {rate['ngram']:>12.1f} "
                      f"{rate['ngram'] / rate['plain']:>5.2f}x {accepted / max(proposed, 1):>7.2f} "
                      f"{same:>2}/{len(batch)}   load {open('/proc/loadavg').read().split()[0]}", flush=True)


if __name__ == "__main__":
    main()
