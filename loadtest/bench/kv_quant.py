"""Quantized KV blocks (``--kv-cache-dtype``) against the model's dtype, on the embedded
SmolLM2-135M-Instruct in bfloat16 (or ``--dtype float32``) at one ``--kv-cache-memory``:

    python -m loadtest.bench.kv_quant [--variants auto,int8,fp8_e4m3] [--streams 16,64] [--tokens 48]
                                [--kv-cache-memory 64MiB] [--dtype bfloat16]

Each variant runs in a fresh process: the offline engine (``services.offline.EngineCore``), the
default kernels (``--attention-backend auto``: numba). It prints the pool's blocks and tokens at
that memory, output tokens per second for each stream count (each stream one of 32 short prompts,
``--tokens`` greedy tokens, EOS ignored; prefill included; a pool too small for a stream count
preempts, which the figure then includes), the greedy agreement with ``auto`` over 32 prompts x 64
tokens (the share of token positions equal, and the share before each stream's first difference;
the variant ``auto/torch``, the model's dtype through the torch reference attention, shows how far
two unquantized kernels of different summation order already drift apart in that dtype),
and one layer's decode attention at batch 64 x 256 tokens (the kernel alone, median of 20).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from loadtest.bench.quantized import generate
from loadtest.common.machine_state import print_cpu

TOPICS = ("the moon", "bread", "rivers", "chess", "volcanoes", "bicycles", "the ocean", "music",
          "honey bees", "winter", "libraries", "trains", "gardens", "the sun", "mountains", "coffee",
          "clocks", "rain", "maps", "castles", "forests", "paper", "glass", "bridges", "whales",
          "deserts", "electricity", "islands", "owls", "cheese", "stars", "robots")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _prompts(tokenizer) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": f"Write a short paragraph about {t}."}],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
            for t in TOPICS]


def _attention_ms(runner, variant: str) -> float:
    """One layer's decode attention, batch 64 x 256 tokens in randomly placed blocks of a pool of
    their own (random contents), SmolLM2's heads, on this runner's backend and pool format."""
    import numpy as np
    import torch

    from kernels.kv_quant import QuantCache, quantize

    plan = runner.model.plan
    k = runner.kv_caches[0][0]
    block_size, rows = runner.block_size, 64
    per_seq = 256 // block_size
    shape = (rows * per_seq + 16, plan.num_local_kv_heads, block_size, k.shape[3])
    tables = torch.randperm(shape[0])[:rows * per_seq].reshape(rows, per_seq).to(torch.int32)
    lens = torch.full((rows,), 256, dtype=torch.int32)
    pools = [torch.randn(shape).to(torch.bfloat16) for _ in range(2)]
    fmt = variant.partition("/")[0]
    if fmt != "auto":
        pools = [QuantCache(*quantize(p.float(), fmt), fmt) for p in pools]
    query = torch.randn(rows, plan.num_local_heads, shape[3]).to(torch.bfloat16)
    out = torch.empty_like(query)
    times = []
    for _ in range(21):
        t0 = time.perf_counter()
        runner.backend.decode(out, query, *pools, tables, lens, 0.125)
        times.append(time.perf_counter() - t0)
    return round(float(np.median(times[1:])) * 1e3, 3)


def child(variant: str, streams: list[int], tokens: int, memory: str, dtype: str) -> dict:
    from shared.cpu_threads import configure_cpu_threads

    configure_cpu_threads(None)  # as the executor: one OpenMP runtime for torch and numba, before torch
    import torch

    from services.executor.loader import RunnerOptions, build_runner
    from services.executor.weights import load_hf_config, load_weights
    from services.offline import EngineCore
    from shared.model_source import load_tokenizer, resolve_model

    source = resolve_model(None)
    fmt, _, backend = variant.partition("/")  # "auto/torch": the reference attention, a noise floor
    options = RunnerOptions(dtype=getattr(torch, dtype), kv_cache_memory=memory, num_cpu_blocks=0, kv_cache_dtype=fmt,
                            attention_backend=backend or "auto")
    config = load_hf_config(source)
    runner = build_runner(config, load_weights(source, config, "none")[0], options)
    prompts = _prompts(load_tokenizer(source, "--model"))
    engine = EngineCore(runner)
    generate(engine, prompts, 2, 4, "warm")
    result = {"variant": variant, "num_blocks": runner.num_blocks, "tokens_in_pool": runner.num_blocks * runner.block_size,
              "kv_mib": round(runner.kv_cache_bytes / 2**20, 1), "tok_s": {}}
    _, result["agreement_tokens"] = generate(engine, prompts, 32, 64, "agree")
    result["preemptions"] = {}
    for n in streams:
        before = engine.scheduler.stats.num_preemptions
        result["tok_s"][str(n)] = round(generate(engine, prompts, n, tokens, f"s{n}")[0], 1)
        result["preemptions"][str(n)] = engine.scheduler.stats.num_preemptions - before
    result["attention_ms"] = _attention_ms(runner, variant)
    return result


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(share of positions equal, share of positions before each stream's first difference)."""
    total = sum(len(x) for x in a)
    equal = sum(p == q for x, y in zip(a, b) for p, q in zip(x, y))
    prefix = sum(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a, b))
    return equal / total, prefix / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="auto,int8,fp8_e4m3")
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--kv-cache-memory", default="64MiB")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    print_cpu()
    streams = [int(s) for s in args.streams.split(",")]
    if args.child:
        print(json.dumps(child(args.child, streams, args.tokens, args.kv_cache_memory, args.dtype)))
        return
    runs = {}
    for v in args.variants.split(","):
        say(f"{v} ...")
        out = subprocess.run([sys.executable, "-m", "loadtest.bench.kv_quant", "--child", v, "--streams", args.streams,
                              "--tokens", str(args.tokens), "--kv-cache-memory", args.kv_cache_memory,
                              "--dtype", args.dtype],
                             capture_output=True, text=True, check=True)
        runs[v] = json.loads(out.stdout.strip().splitlines()[-1])
        say(f"  {runs[v]['num_blocks']} blocks, {runs[v]['tok_s']} tok/s, attention {runs[v]['attention_ms']} ms")
    base = runs.get("auto")
    head = (["--kv-cache-dtype", f"blocks in {args.kv_cache_memory}", "tokens"] + [f"{n} streams tok/s" for n in streams]
            + ["decode attention ms (1 layer, 64 x 256)", "greedy agreement with auto (equal / before first difference)"])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for v, r in runs.items():
        agree = "-"
        if base is not None and v != "auto":
            equal, prefix = agreement(r["agreement_tokens"], base["agreement_tokens"])
            agree = f"{equal:.1%} / {prefix:.1%}"
        rates = [f"{r['tok_s'][str(n)]}" + (f" ({r['preemptions'][str(n)]} preemptions)" if r["preemptions"][str(n)] else "")
                 for n in streams]
        print(f"| {v} | {r['num_blocks']} | {r['tokens_in_pool']} | " + " | ".join(rates)
              + f" | {r['attention_ms']} | {agree} |")


if __name__ == "__main__":
    main()
