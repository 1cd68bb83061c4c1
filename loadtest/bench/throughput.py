"""Throughput of pagedserve against a peer server and Hugging Face static batching, same requests.

    python -m loadtest.bench.throughput [--num-requests 64] [--static-batch 16] [--seed 0]
    python -m loadtest.bench.throughput --peer-url http://127.0.0.1:8100 --skip-hf [--server-flags "--dtype float32"]
    python -m loadtest.bench.throughput --peer-url http://127.0.0.1:8100 --skip-hf --rounds 4 --seed 100
    python -m loadtest.bench.throughput --tensor-parallel-size 2 --skip-hf
    python -m loadtest.bench.throughput --data-parallel-size 2 --skip-hf

Starts ``pagedserve serve`` on SmolLM2 (or uses ``--url``), sends every request at once (token-id
prompts of varied length, varied ``max_tokens``, ``ignore_eos`` so lengths are exact), and measures
output tokens per second, time to first token and KV slot utilization. With ``--peer-url`` the same
requests then go to another OpenAI-compatible server (vLLM-CPU from ``../shared/peers/``, say; its
model name is read from its ``/v1/models``), one server at a time. Each server is first sent
``--warmup`` requests (the workload's prompt lengths, another seed, a few output tokens): a fresh
pagedserve is started for every run while a peer is usually left running between runs, so without
it the comparison would set one server's first requests (new shapes to compile and tune) against
the other's warm ones. A peer left running also keeps its prefix cache (vLLM caches prefixes by
default): requests it has seen before, from an earlier run with the same ``--seed`` (``--num-requests
1`` and ``8`` send the first prompts of the 64), are then mostly cache hits there, while the
pagedserve started here begins empty. Give every run against the same peer start its own
``--seed``. ``--rounds N`` measures N workloads (seeds ``--seed`` to ``--seed + N - 1``) on every
server, which stay up between them, the servers' order alternating (ours first, then the peer
first: a drift of the machine's speed, which on this project's shared VMs moves step times by up to
2x within minutes, then weighs on both alike); it prints each round, the medians over rounds, and
the per-round ratios with their median. Every run also reports the CPU steal time (the share of
the VM's CPU time its host took meanwhile, from ``/proc/stat``), and starts only once the machine
is quiet (``wait_for_quiet``: a server may keep a core busy after its last response). Unless ``--skip-hf``, Hugging Face
``generate`` then runs with static batches (left-padded, each batch decoding until its longest
request is done) on the same requests (the first round's), in the same thread settings. Prints all with the ratios to
the first, and the CPU's model and the instruction-set flags that decide the fast paths.
``--data-parallel-size N`` serves ``-dp N`` replicas, the ``--threads`` shared among all their ranks.
``--tensor-parallel-size N`` serves with ``-tp N``, the ``--threads`` shared among the N ranks; when
SmolLM2's 9 heads do not split N ways (``-tp 2``), it serves a random model of SmolLM2's sizes
with narrower heads instead (``shaped_model``: same matmuls and KV bytes per token), and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass

from loadtest.common.machine_state import QUIET_REPORT_S, CpuSteal, cpu_description, wait_for_quiet
from loadtest.bench.servers import _get_json, served_model_name, start_server
from loadtest.bench.throughput_report import median_summary, print_round_ratios, print_table, say, summarize
from shared.hub_kernels import hide_hub_kernels


# output tokens of each warm-up request (``--warmup``): enough to reach the decode steps
WARMUP_OUTPUT_TOKENS = 8
# the warm-up's prompts come from --seed plus this: far from the seeds of the runs measured
WARMUP_SEED_OFFSET = 10007


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class Result:
    ttft_s: float
    latency_s: float
    num_output_tokens: int


def make_workload(n: int, seed: int, vocab: int, prompt_range, output_range) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        reqs.append(Request([rng.randrange(100, vocab) for _ in range(plen)], rng.randint(*output_range)))
    return reqs


# ---------------------------------------------------------------- pagedserve


async def completion_chunks(session, url: str, body: dict):
    """POST ``body`` to ``/v1/completions`` with ``stream`` on; yields each server-sent event's
    JSON chunk as it arrives (``data: [DONE]`` and other lines skipped) until the body ends."""
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            yield json.loads(line[6:])


async def stream_completion(session, url: str, body: dict, t_start: float) -> tuple[float, dict]:
    """POST a streamed completion with usage; returns (seconds to the first choice chunk, usage)."""
    ttft = None
    usage = None
    async for chunk in completion_chunks(session, url, {**body, "stream_options": {"include_usage": True}}):
        if chunk.get("choices") and ttft is None:
            ttft = time.monotonic() - t_start
        usage = chunk.get("usage") or usage
    return ttft or 0.0, usage


async def _one(session, url: str, model: str, req: Request, t_start: float) -> Result:
    body = {"model": model, "prompt": req.prompt_ids, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True}
    ttft, usage = await stream_completion(session, url, body, t_start)
    return Result(ttft, time.monotonic() - t_start, usage["completion_tokens"])


async def run_server(url: str, model: str, reqs: list[Request], label: str = "pagedserve"):
    """Send every request at once to an OpenAI-compatible server; (results, elapsed seconds)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(_one(session, url, model, r, t0)) for r in reqs]
        done = 0
        for fut in asyncio.as_completed(tasks):
            await fut
            done += 1
            if done % 8 == 0:
                say(f"  {label}: {done}/{len(reqs)} requests done ({time.monotonic() - t0:.0f} s)")
        results = [t.result() for t in tasks]
        return results, time.monotonic() - t0


# ---------------------------------------------------------------- Hugging Face static batching


def run_hf_static(reqs: list[Request], batch_size: int, threads: int):
    import torch
    hide_hub_kernels()
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from shared.model_source import resolve_model

    torch.set_num_threads(threads)
    src = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32, **src.pretrained_kwargs()).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2 and self.first is None:  # call 1 is the prompt
                self.first = time.monotonic()

        def end(self):
            pass

    results, used, allocated = [], 0, 0
    t0 = time.monotonic()
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b:b + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        new = max(r.max_tokens for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        streamer = FirstToken()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad, streamer=streamer)
        end = time.monotonic()
        for r in batch:
            results.append(Result(streamer.first - t0, end - t0, r.max_tokens))
        used += sum(len(r.prompt_ids) + r.max_tokens for r in batch)
        allocated += len(batch) * (width + new)
        say(f"  HF static: {min(b + batch_size, len(reqs))}/{len(reqs)} requests done ({end - t0:.0f} s)")
    return results, time.monotonic() - t0, used / allocated


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--static-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="workloads measured on every server, round r with --seed + r, the servers' order "
                         "alternating (ABBA); medians and per-round ratios are printed (default 1)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--server-flags", default="", help="extra flags for pagedserve serve")
    ap.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                    help="executor ranks of the pagedserve started here (its -tp); --threads are shared among them")
    ap.add_argument("-dp", "--data-parallel-size", type=int, default=1,
                    help="replicas of the pagedserve started here (its -dp); --threads are shared among all their ranks")
    ap.add_argument("--url", default=None, help="measure a pagedserve already running there instead of starting one")
    ap.add_argument("--peer-url", default=None,
                    help="also send the same requests to this OpenAI-compatible server (e.g. vLLM-CPU)")
    ap.add_argument("--peer-name", default="peer", help="the peer's column title")
    ap.add_argument("--warmup", type=int, default=None,
                    help="requests sent to each server before it is first measured (prompts like the workload's, "
                         f"--seed + {WARMUP_SEED_OFFSET}, {WARMUP_OUTPUT_TOKENS} output tokens each; default: as many as "
                         "--num-requests; 0: none)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    workloads = [make_workload(args.num_requests, args.seed + r, 49152, args.prompt_len, args.output_len)
                 for r in range(args.rounds)]
    say(f"machine: {cpu_description()}")
    for i, reqs in enumerate(workloads):
        which = f" of round {i + 1}" if args.rounds > 1 else ""
        say(f"workload{which}: {len(reqs)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens "
            f"(sum {sum(len(r.prompt_ids) for r in reqs)}), outputs {args.output_len[0]}-{args.output_len[1]} "
            f"(sum {sum(r.max_tokens for r in reqs)}), seed {args.seed + i}, {args.threads} threads")

    n = args.num_requests if args.warmup is None else args.warmup
    warmup = [Request(r.prompt_ids, WARMUP_OUTPUT_TOKENS)
              for r in make_workload(n, args.seed + WARMUP_SEED_OFFSET, 49152, args.prompt_len, args.output_len)]
    with pagedserve_server(args) as url:
        servers = [Server("pagedserve", url, served_model_name(url), ours=True)]
        if args.peer_url:
            servers.append(Server(args.peer_name, args.peer_url, served_model_name(args.peer_url)))
        rounds = measure_rounds(servers, workloads, warmup)
    rows = [(server.name, median_summary([r[server.name] for r in rounds])) for server in servers]
    if not args.skip_hf:
        which = " (on the first round's workload)" if args.rounds > 1 else ""
        say(f"running Hugging Face generate, static batches of {args.static_batch}{which} ...")
        steal = CpuSteal()
        hf, hf_elapsed, hf_util = run_hf_static(workloads[0], args.static_batch, args.threads)
        hf_s = summarize(hf, hf_elapsed)
        hf_s["CPU steal (%)"] = steal.percent()
        hf_s["KV slot utilization"] = hf_util
        rows.append((f"HF static ({args.static_batch})", hf_s))
    for _, s in rows[1:]:
        s.setdefault("KV slot utilization", float("nan"))
    if args.rounds > 1:
        say(f"\nmedians of {args.rounds} rounds (CPU steal: the share of this machine's CPU time its host took "
            "during the run)")
    print_table(rows)
    if args.rounds > 1 and len(servers) > 1:
        print_round_ratios(rounds, servers[0].name, servers[1].name)


@dataclass
class Server:
    name: str
    url: str
    model: str
    ours: bool = False


def measure_rounds(servers: list[Server], workloads: list[list[Request]], warmup: list[Request]
                   ) -> list[dict[str, dict[str, float]]]:
    """Each workload on every server, one at a time: round r in the servers' order, reversed in
    odd rounds (ABBA, so that a drift of the machine's speed weighs on both alike). A server gets
    the ``warmup`` requests right before its first measured run. Returns per round the summaries
    by server name."""
    warmed: set[str] = set()
    rounds = []
    for r, reqs in enumerate(workloads):
        summaries = {}
        for server in servers if r % 2 == 0 else servers[::-1]:
            if warmup and server.name not in warmed:
                say(f"warming {server.name} up with {len(warmup)} requests ...")
                asyncio.run(run_server(server.url, server.model, warmup, f"{server.name} warm-up"))
            warmed.add(server.name)
            if not server.ours:
                say(f"sending the same requests to {server.name} at {server.url} (model {server.model}) ...")
            settled = wait_for_quiet()
            if settled is not None and settled >= QUIET_REPORT_S:
                say(f"  waited {settled:.1f} s for the machine to fall quiet before measuring {server.name}")
            steal = CpuSteal()
            results, elapsed = asyncio.run(run_server(server.url, server.model, reqs, server.name))
            summary = summarize(results, elapsed)
            summary["CPU steal (%)"] = steal.percent()
            if server.ours:
                summary["KV slot utilization"] = _health_of(server.url)
            summaries[server.name] = summary
        if len(workloads) > 1:
            say(f"round {r + 1}/{len(workloads)}: " + ", ".join(
                f"{name} {s['output tokens/s']:.1f} tok/s, TTFT p50 {s['median TTFT (s)']:.2f} s, "
                f"steal {s['CPU steal (%)']:.1f}%" for name, s in summaries.items()))
        rounds.append(summaries)
    return rounds


def _health_of(url: str) -> float:
    """pagedserve's KV slot utilization (its /health), and its group, said once per run."""
    health = _get_json(f"{url}/health")
    replicas = health.get("replicas") or [health]  # -dp: each replica's own report
    group = replicas[0].get("group", {})
    say(f"pagedserve: {len(replicas)} replica(s) of {group.get('world_size', 1)} rank(s), all-reduce "
        f"{group.get('all_reduce', 'single')}, KV blocks per rank {group.get('num_kv_blocks_per_rank')}")
    util = health.get("kv_slot_utilization")
    return float("nan") if util is None else util


def _model_flags(world_size: int, directory: str) -> list[str]:
    """SmolLM2 (the default), or a random model of its sizes whose heads split ``world_size`` ways
    (saved in ``directory``)."""
    from loadtest.common.shaped_model import smollm2_shaped_for

    path = smollm2_shaped_for(world_size, directory)
    if path is None:
        return []
    say(f"SmolLM2's 9 heads do not split {world_size} ways: serving {os.path.basename(path)}, random weights "
        f"of SmolLM2's sizes (same matmuls and KV bytes per token)")
    return ["--model", path, "--served-model-name", "SmolLM2-135M-Instruct"]


@contextlib.contextmanager
def pagedserve_server(args):
    """The URL of the pagedserve to measure: ``--url``, or one started here (stopped on exit)."""
    if args.url is not None:
        yield args.url
        return
    model_dir = tempfile.TemporaryDirectory(prefix="pagedserve-throughput-")
    proc = None
    try:
        say("starting pagedserve ...")
        threads_per_rank = max(1, args.threads // (args.tensor_parallel_size * args.data_parallel_size))
        flags = ["--max-num-seqs", str(max(64, args.num_requests)), "--num-threads", str(threads_per_rank),
                 "-tp", str(args.tensor_parallel_size), "-dp", str(args.data_parallel_size),
                 *_model_flags(args.tensor_parallel_size, model_dir.name),
                 *args.server_flags.split()]
        proc, url = start_server(flags)
        yield url
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        model_dir.cleanup()


if __name__ == "__main__":
    main()
