"""KV offload tiers: time to first token after a restart, cold against the disk tier, and blocks per
second through each tier.

    python -m loadtest.bench.kv_tiers [--num-docs 5]

1. Fill: a server with ``--kv-offload-memory`` and ``--kv-offload-dir`` (a small device pool and
   host tier) reads ``--num-docs`` documents of about 2,000 tokens, then a flood of other ones that
   pushes them out of the device pool and the host tier into files; it is stopped (SIGTERM: the
   executor finishes its writes).
2. Restarted: a new server on the same directory gets one question about each document; each is
   the document's first request since the restart (its blocks come from the files).
3. Cold: a server without tiers gets the same questions.
TTFT p50 of the questions is compared (the issue's target: tiers at most 0.3x of cold). Then the
tiers' copies are timed in process, on SmolLM2's block shape in bfloat16 (numba kernels): device
pool -> host pool, back, host -> file (checksum, atomic rename), file -> host (read, verify).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
import statistics
import tempfile
import time

from loadtest.bench.servers import start_server
from loadtest.bench.throughput import say, stream_completion

WORDS = ("river garden market window teacher morning village history letter summer doctor winter "
         "kitchen mountain library station engine island bridge forest harbour castle painter "
         "student question answer number silver yellow quiet gentle ancient modern careful").split()
MODEL = "SmolLM2-135M-Instruct"
SERVER = ["--num-kv-blocks", "200", "--max-num-seqs", "4"]
TIERS = ["--kv-offload-memory", "0.05"]  # 145 blocks: a document fits


def document(i: int, num_words: int = 2000) -> str:
    rng = random.Random(i)
    return f"Document {i}.\n" + " ".join(rng.choice(WORDS) for _ in range(num_words))


async def _ask(url: str, texts: list[str]) -> list[tuple[float, int]]:
    """Each text in turn (one at a time): (TTFT, cached prompt tokens, prompt tokens)."""
    import aiohttp

    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for text in texts:
            body = {"model": MODEL, "prompt": text, "max_tokens": 4, "temperature": 0}
            t0 = time.monotonic()
            ttft, usage = await stream_completion(session, url, body, t0)
            out.append((ttft, (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                        usage["prompt_tokens"]))
    return out


def _serve_and_ask(flags: list[str], texts: list[str], what: str):
    say(f"{what}: starting pagedserve ...")
    proc, url = start_server(SERVER + flags, log_path=f"/tmp/pagedserve-kv-tiers-{what}.log")
    try:
        return asyncio.run(_ask(url, texts))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def restart_ttft(num_docs: int) -> None:
    directory = tempfile.mkdtemp(prefix="pagedserve-kv-bench-")
    docs = [document(i) for i in range(num_docs)]
    flood = [document(1000 + i) for i in range(3)]
    questions = [f"{d}\nQuestion: what is the first word of document {i}?" for i, d in enumerate(docs)]
    tiered = TIERS + ["--kv-offload-dir", directory]
    try:
        filled = _serve_and_ask(tiered, docs + flood, "fill")
        restarted = _serve_and_ask(tiered, questions, "restarted")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    cold = _serve_and_ask([], questions, "cold")
    say(f"prompt tokens per document: {filled[0][2]}; cached after the restart: {[r[1] for r in restarted]}")
    p_cold, p_tiers = (statistics.median(r[0] for r in rows) for rows in (cold, restarted))
    say(f"TTFT p50 after a restart: cold {p_cold * 1000:.0f} ms, disk tier {p_tiers * 1000:.0f} ms, "
        f"ratio {p_tiers / p_cold:.2f}x (target <= 0.3x)")


def tier_throughput(num_blocks: int = 256) -> None:
    """Blocks/s through each tier's copy, SmolLM2's block shape (30 layers, 3 KV heads, 64 dims, 16 slots)."""
    import numpy as np
    import torch

    from services.executor.attention import select_backend
    from services.executor.kv_files import BlockFiles
    from services.executor.kv_offload import LOAD, OFFLOAD, RELOAD, SPILL, KvOffload
    from shared.messages import Step

    shape = (num_blocks, 3, 16, 64)
    pool = [(torch.randn(shape).to(torch.bfloat16), torch.randn(shape).to(torch.bfloat16)) for _ in range(30)]
    host = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)) for _ in range(30)]
    directory = tempfile.mkdtemp(prefix="pagedserve-kv-bench-")
    offload = KvOffload(host, BlockFiles(directory, {"bench": 1}), 10 * 2**30)
    backend = select_backend("numba", torch.device("cpu"))
    keys = [i.to_bytes(16, "little") for i in range(num_blocks)]

    def run(kind: str, ops: list[tuple[int, int, int]]) -> None:
        step = Step(0, 0, *(np.zeros(0, np.int64),) * 4, np.zeros(1, np.int32), np.zeros(0, np.int32),
                    np.zeros((0, 0), np.int32), np.zeros(0, bool))
        step.tier_ops, step.tier_keys = np.array(ops, np.int64), keys
        offload.apply(step, pool, backend)  # once to compile the kernels
        offload.flush()
        t0 = time.perf_counter()
        offload.apply(step, pool, backend)
        if kind == "host -> file":
            offload.flush()
        seconds = time.perf_counter() - t0
        say(f"  {kind:16} {num_blocks / seconds:10.0f} blocks/s ({num_blocks * offload.payload_bytes / seconds / 2**20:7.0f} MiB/s)")

    try:
        say(f"blocks/s through each tier ({offload.payload_bytes} bytes a block):")
        run("device -> host", [(OFFLOAD, i, i) for i in range(num_blocks)])
        run("host -> device", [(RELOAD, i, i) for i in range(num_blocks)])
        run("host -> file", [(SPILL, i, i) for i in range(num_blocks)])
        run("file -> host", [(LOAD, i, i) for i in range(num_blocks)])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-docs", type=int, default=5)
    ap.add_argument("--skip-server", action="store_true", help="only the tiers' copies")
    args = ap.parse_args()
    tier_throughput()
    if not args.skip_server:
        restart_ttft(args.num_docs)


if __name__ == "__main__":
    main()
