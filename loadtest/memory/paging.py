"""What paging buys: the same workload and the same KV pool under ``--kv-policy paged`` and ``contiguous``.

    python -m loadtest.memory.paging [--num-requests 48] [--num-kv-blocks 128] [--max-model-len 512]

Each policy gets a fresh ``pagedserve serve`` on SmolLM2 with the same pool. Requests are chat
questions answered greedily until EOS (so output lengths are unknown in advance, as in real
serving; ``max_tokens`` is left to its default, the rest of the context). Prints the maximum number
of sequences in flight, mean KV slot utilization (slots holding tokens / slots allocated, averaged
over steps), preemptions and output tokens per second, with the paged / contiguous ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

from loadtest.bench.servers import _get_json, start_server
from loadtest.bench.throughput import say

TOPICS = ["the ocean", "volcanoes", "honey bees", "the Roman empire", "black holes", "bread baking",
          "chess openings", "the water cycle", "electric cars", "photosynthesis", "the moon landing",
          "jazz music", "rainforests", "the printing press", "glaciers", "vaccines"]
ASKS = ["Explain {} to a ten-year-old.", "Give three facts about {}.", "Write a short poem about {}.",
        "What is the most surprising thing about {}?"]


def questions(n: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(TOPICS[(i * 7) % len(TOPICS)]) for i in range(n)]


async def _ask(session, url: str, question: str) -> int:
    body = {"model": "SmolLM2-135M-Instruct", "temperature": 0,
            "messages": [{"role": "user", "content": question}]}
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        payload = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {payload}")
        return payload["usage"]["completion_tokens"]


async def _run_all(url: str, qs: list[str]) -> tuple[int, float]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(_ask(session, url, q)) for q in qs]
        done = 0
        for fut in asyncio.as_completed(tasks):
            await fut
            done += 1
            if done % 8 == 0:
                say(f"  {done}/{len(qs)} done ({time.monotonic() - t0:.0f} s)")
        return sum(t.result() for t in tasks), time.monotonic() - t0


def run_policy(policy: str, args) -> dict[str, float]:
    say(f"policy {policy}: starting pagedserve ...")
    proc, url = start_server(["--kv-policy", policy, "--num-kv-blocks", str(args.num_kv_blocks),
                              "--max-model-len", str(args.max_model_len), "--max-num-seqs", "256"])
    try:
        tokens, elapsed = asyncio.run(_run_all(url, questions(args.num_requests)))
        time.sleep(1.0)  # one more stats message after the last step
        health = _get_json(f"{url}/health")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    return {"max sequences in flight": health["max_num_running"],
            "mean KV slot utilization": health["kv_slot_utilization"],
            "preemptions": health["num_preemptions"],
            "output tokens": tokens,
            "output tokens/s": tokens / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--num-kv-blocks", type=int, default=128, help="pool size, 16-token blocks")
    ap.add_argument("--max-model-len", type=int, default=512)
    args = ap.parse_args()
    say(f"{args.num_requests} chat requests, pool {args.num_kv_blocks} blocks x 16 slots, "
        f"max model length {args.max_model_len}")
    results = {p: run_policy(p, args) for p in ("paged", "contiguous")}
    say("")
    say(f"{'':28}{'paged':>12}{'contiguous':>12}{'ratio':>8}")
    for key in results["paged"]:
        p, c = results["paged"][key], results["contiguous"][key]
        ratio = f"{p / c:8.2f}" if c else f"{'-':>8}"
        say(f"{key:28}{p:>12.3f}{c:>12.3f}{ratio}")


if __name__ == "__main__":
    main()
