"""Automatic prefix caching on a shared few-shot prefix: throughput and time to first token, on vs off.

    python -m loadtest.bench.prefix [--num-requests 32] [--max-tokens 16]

Like the paper's translation workload: every request starts with the same few-shot examples (one
or five) and ends with its own sentence. Each configuration gets a fresh ``pagedserve serve`` on
SmolLM2 (``--no-prefix-caching`` for "off"); all requests are sent at once. The paper gains 1.67x
with one example and 3.58x with five.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import time

from loadtest.bench.servers import _get_json, start_server
from loadtest.bench.throughput import say, stream_completion
from loadtest.common.machine_state import print_cpu

EXAMPLES = [
    ("The weather is lovely today, so we are going to walk along the river after lunch.",
     "Il fait très beau aujourd'hui, alors nous allons nous promener le long de la rivière après le déjeuner."),
    ("My grandmother keeps a small garden with tomatoes, beans and a very old apple tree.",
     "Ma grand-mère entretient un petit jardin avec des tomates, des haricots et un très vieux pommier."),
    ("The train to the capital leaves at seven in the morning and arrives before noon.",
     "Le train pour la capitale part à sept heures du matin et arrive avant midi."),
    ("Please remember to close the windows before you leave the house tonight.",
     "N'oubliez pas de fermer les fenêtres avant de quitter la maison ce soir."),
    ("The museum opened a new exhibition about the history of printing and paper.",
     "Le musée a ouvert une nouvelle exposition sur l'histoire de l'imprimerie et du papier."),
]
SENTENCES = ["The children are playing in the park.", "I would like a cup of coffee, please.",
             "Our neighbours bought a red car.", "The library closes early on Sundays.",
             "She reads a book every week.", "We missed the last bus home.",
             "The soup needs more salt.", "He plays the piano very well."]


def prompt(num_examples: int, i: int) -> str:
    shots = "".join(f"English: {en}\nFrench: {fr}\n\n" for en, fr in EXAMPLES[:num_examples])
    return f"Translate English to French.\n\n{shots}English: {SENTENCES[i % len(SENTENCES)]} ({i})\nFrench:"


async def _one(session, url: str, text: str, max_tokens: int, t0: float) -> tuple[float, int, int]:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    ttft, usage = await stream_completion(session, url, body, t0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft, usage["completion_tokens"], cached


async def _run(url: str, texts: list[str], max_tokens: int):
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.monotonic()
        results = await asyncio.gather(*(_one(session, url, t, max_tokens, t0) for t in texts))
        return results, time.monotonic() - t0


def measure(num_examples: int, caching: bool, args) -> dict[str, float]:
    say(f"{num_examples} example(s), prefix caching {'on' if caching else 'off'}: starting pagedserve ...")
    flags = ["--max-num-seqs", "64"] + ([] if caching else ["--no-prefix-caching"])
    proc, url = start_server(flags)
    try:
        texts = [prompt(num_examples, i) for i in range(args.num_requests)]
        results, elapsed = asyncio.run(_run(url, texts, args.max_tokens))
        health = _get_json(f"{url}/health")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    return {"requests/s": len(results) / elapsed,
            "output tokens/s": sum(r[1] for r in results) / elapsed,
            "mean TTFT (s)": statistics.mean(r[0] for r in results),
            "cached prompt tokens": sum(r[2] for r in results),
            "max running": health.get("max_num_running", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    print_cpu()
    table = []
    for shots in (1, 5):
        on, off = measure(shots, True, args), measure(shots, False, args)
        table.append((shots, on, off))
    say("")
    for shots, on, off in table:
        say(f"{shots} example(s):{'on':>14}{'off':>12}{'on/off':>9}")
        for key in on:
            ratio = f"{on[key] / off[key]:9.2f}" if off[key] else f"{'-':>9}"
            say(f"  {key:22}{on[key]:>12.3f}{off[key]:>12.3f}{ratio}")


if __name__ == "__main__":
    main()
