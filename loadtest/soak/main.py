"""A soak under faults: steady mixed load on ``pagedserve serve`` while the executor and then the
scheduler are killed (``kill -9``), and a report of what every client saw.

    python -m loadtest.soak [--minutes 10] [--model DIR_OR_GGUF | --tiny] [--concurrency 8]

Default model: the embedded SmolLM2-135M-Instruct (float32, so greedy output is exact); ``--tiny``
builds a tiny random Llama with SmolLM2's tokenizer for quick runs. The load (``soak_clients``):
greedy completions, streamed and not, checked token for token against a greedy reference taken
before the load; sampled streams with ``n = 2``; streamed chat; best_of; clients that disconnect
mid-stream; bad requests. The executor is killed at a third of the run, the scheduler at two
thirds. The report: requests sent, completed, failed with a clear error, refused (503 with
Retry-After while the scheduler restarts), rejected bad requests, disconnects, unclear endings,
hung (must be 0); greedy tokens lost or repeated (must be 0); KV blocks free at the end (must be
all); each process's memory after warm-up and at the end (growth must stay under 10 %). Exit
status 1 if any of these fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request

import aiohttp

from loadtest.common.procs import child_argvs
from loadtest.soak.clients import GREEDY_PROMPTS, Outcome, Soak, greedy_tokens, one_request
from loadtest.bench.servers import _get_json, start_server
from loadtest.bench.throughput import say
from shared.hub_kernels import hide_hub_kernels

SERVICES = ("scheduler", "executor", "frontend")


def children(pid: int) -> dict[str, int]:
    """``serve``'s service name -> pid, read from /proc."""
    return {argv[argv.index("services.cli") + 1]: child for child, argv in child_argvs(pid).items()
            if "services.cli" in argv[:-1]}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def tiny_model_dir() -> str:
    hide_hub_kernels()
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.model_source import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(None))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False)
    directory = tempfile.mkdtemp(prefix="soak-tiny-model-")
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


async def load(soak: Soak, concurrency: int, seconds: float, proc, outcomes: list[Outcome]) -> None:
    """``concurrency`` clients in a loop for ``seconds``; kills the executor, then the scheduler."""
    deadline = time.monotonic() + seconds
    faults = [(seconds / 3, "executor"), (2 * seconds / 3, "scheduler")]
    started = time.monotonic()

    async def client(session) -> None:
        while time.monotonic() < deadline:
            outcomes.append(await one_request(session, soak))

    async def killer() -> None:
        for at_s, service in faults:
            await asyncio.sleep(max(0.0, started + at_s - time.monotonic()))
            pid = children(proc.pid)[service]
            say(f"  {time.monotonic() - started:5.0f} s: kill -9 the {service} (pid {pid}); "
                f"{len(outcomes)} requests so far")
            os.kill(pid, signal.SIGKILL)

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(killer(), *(client(session) for _ in range(concurrency)))


async def greedy_reference(soak: Soak) -> None:
    async with aiohttp.ClientSession() as session:
        for idx in range(len(GREEDY_PROMPTS)):
            tokens = await greedy_tokens(session, soak, idx, stream=False)
            if isinstance(tokens, Outcome):
                raise SystemExit(f"the greedy reference failed: {tokens}")
            soak.reference[idx] = tokens


def wait_idle(url: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            health = _get_json(f"{url}/health")
            if health["num_running"] == 0 and health["num_waiting"] == 0 and health["num_blocks_used"] == 0:
                return health
        except OSError:
            health = None
        if time.monotonic() > deadline:
            return health or {}
        time.sleep(0.5)


def report(outcomes: list[Outcome], health: dict, restarts: dict[str, float], memory: dict) -> bool:
    by_status = collections.Counter(o.status for o in outcomes)
    checked = [o for o in outcomes if o.checked]
    lost, repeated = sum(o.tokens_lost for o in checked), sum(o.tokens_repeated for o in checked)
    say(f"requests sent: {len(outcomes)}")
    labels = {"completed": "completed", "error": "failed with a clear error",
              "refused": "refused with 503 + Retry-After (scheduler restarting)",
              "rejected": "bad requests rejected with a 4xx, as they should be",
              "disconnected": "clients that disconnected mid-stream on purpose",
              "unclear": "ended without a clear error (must be 0)", "hung": "hung (must be 0)"}
    for status, label in labels.items():
        say(f"  {by_status.get(status, 0):6d}  {label}")
    for o in outcomes:
        if o.status in ("error", "unclear", "hung"):
            say(f"    {o.status} ({o.kind}): {o.detail[:200]}")
    by_kind = collections.Counter((o.kind, o.status) for o in outcomes)
    say("  by kind: " + ", ".join(f"{k}/{s}={n}" for (k, s), n in sorted(by_kind.items())))
    say(f"greedy requests checked against the reference: {len(checked)}; tokens lost: {lost}, repeated: {repeated}")
    total, used = health.get("num_blocks_total", -1), health.get("num_blocks_used", -1)
    say(f"KV blocks free at the end: {total - used} of {total}")
    say("restarts (from /metrics): " + ", ".join(f"{k} {v:g}" for k, v in restarts.items()))
    say("memory (RSS MiB, after warm-up -> end; a restarted process against the one it replaced):")
    ok_memory = True
    for service, (start, end) in memory.items():
        growth = (end - start) / start
        ok_memory &= growth < 0.10
        say(f"  {service:10s} {start:8.1f} -> {end:8.1f}  ({100 * growth:+.1f} %)")
    passed = (by_status.get("hung", 0) == 0 and by_status.get("unclear", 0) == 0 and lost == 0 and repeated == 0
              and used == 0 and ok_memory
              and restarts.get("executor", 0) >= 1 and restarts.get("scheduler", 0) >= 1)
    say("PASS" if passed else "FAIL")
    return passed


def restart_counts(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1])
            for line in lines if line.startswith("pagedserve:process_restarts_total{")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead (quick runs)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = tiny_model_dir() if args.tiny else args.model
    flags = ["--dtype", "float32", "--served-model-name", "soak", "--max-model-len", "512", "--max-restarts", "10"]
    proc, url = start_server(flags + (["--model", model] if model else []))
    soak = Soak(url, "soak")
    soak.rng.seed(args.seed)
    outcomes: list[Outcome] = []
    try:
        say(f"server up at {url}; greedy reference on {len(GREEDY_PROMPTS)} prompts")
        asyncio.run(greedy_reference(soak))
        memory = {s: [rss_mib(pid), 0.0] for s, pid in children(proc.pid).items()}
        say(f"load for {args.minutes:g} min with {args.concurrency} clients")
        asyncio.run(load(soak, args.concurrency, 60 * args.minutes, proc, outcomes))
        health = wait_idle(url, 120)
        for service, pid in children(proc.pid).items():
            memory[service][1] = rss_mib(pid)
        passed = report(outcomes, health, restart_counts(url), {s: tuple(v) for s, v in memory.items()})
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        if args.tiny:
            shutil.rmtree(model, ignore_errors=True)
        say("server log: /tmp/pagedserve-throughput-server.log")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
