"""pagedserve against llama.cpp's own ``llama-server`` on the same GGUF files and the same streams
(issue 42's speed comparison).

    python -m loadtest.bench.llama_server [--variants bf16,Q8_0,Q4_1,Q4_K] [--streams 1,8,64] [--rounds 2]

For each variant and stream count both servers are started fresh (both up, measured one at a
time once the machine is quiet), warmed up and sent the same requests: ``S`` streams at once, token-id prompts of
``--prompt-len`` tokens, ``--output-len`` greedy tokens each with ``ignore_eos`` (so that both
produce the same number of tokens), ``--rounds`` times, the servers' order alternating (ABBA). It
prints output tokens per second and TTFT p50 of each, their ratio, the memory of each server once its
rounds are done (PSS of all its processes: ``pagedserve serve`` is several, sharing the KV pool,
which is sized to the tokens of llama-server's ``-c``) and
the weights' bytes (pagedserve's "model loaded" log line; llama-server maps the file, so its size), and
the CPU.

The files: ``Q4_1`` is the embedded SmolLM2-135M-Instruct GGUF (Q4_1 matrices, Q8_0 embedding);
``Q8_0``, ``Q4_0`` and ``Q4_K`` (``Q4_K_M``) are copies of it requantized by llama.cpp's
``llama-quantize --allow-requantize``; ``bf16`` is pagedserve serving the Q4_1 file dequantized to
bfloat16 (``--quantization none``) against llama-server on the ``F16`` copy (llama.cpp's nearest
16-bit file). pagedserve serves the others quantized (``--quantization gguf``).

llama.cpp comes from ``../shared/peers/setup.sh smol llamacpp llama-server gguf`` (its native
``llama-server`` and ``llama-quantize``, compiled for this CPU; ``--peers-dir``, default
``~/.cache/pagedserve/peers-llama``). llama-server runs with ``-np S`` slots of
``--ctx-per-slot`` tokens, continuous batching, ``-t`` the same thread count as pagedserve, and
``--no-repack`` unless ``--llama-repack`` (ggml's repacked AMX/AVX-512 weight layouts stop with an
illegal instruction on some of this project's VMs; see ``loadtest/llama_cpp/scores.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess

from loadtest.bench.servers import _free_port, served_model_name, start_server, wait_until_healthy
from loadtest.bench.throughput import (
    WARMUP_OUTPUT_TOKENS, WARMUP_SEED_OFFSET, Server, make_workload, measure_rounds,
)
from loadtest.bench.throughput_report import say
from loadtest.common.machine_state import cpu_description
from loadtest.common.procs import tree_pss_mib

PEERS = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", "peers-llama")
LLAMA_TYPE = {"bf16": "F16", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_K": "Q4_K_M"}
OURS_LOG = "/tmp/pagedserve-llama-bench.log"
MIB = 1 << 20


def llama_bin(peers: str) -> str:
    return os.path.join(peers, "llamacpp-venv", "llama-server-bin")


def quantize_tool(peers: str) -> str:
    return os.path.join(peers, "build", "llamacpp-cmake", "bin", "llama-quantize")


def variant_file(peers: str, embedded: str, variant: str) -> str:
    """The GGUF file llama-server reads for ``variant`` (made by llama-quantize once, if missing)."""
    if variant == "Q4_1":
        return embedded
    kind = LLAMA_TYPE[variant]
    path = os.path.join(peers, "gguf", f"SmolLM2-135M-Instruct.from-Q4_1.{kind}.gguf")
    if not os.path.exists(path):
        tool = quantize_tool(peers)
        say(f"llama-quantize --allow-requantize -> {os.path.basename(path)} ...")
        subprocess.run([tool, "--allow-requantize", embedded, path + ".partial", kind, "2"], check=True,
                       env={**os.environ, "LD_LIBRARY_PATH": os.path.dirname(tool)},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.replace(path + ".partial", path)
    return path


@contextlib.contextmanager
def llama_server(native: str, path: str, streams: int, ctx_per_slot: int, threads: int, repack: bool,
                 log_path: str = "/tmp/llama-server-bench.log"):
    """``llama-server`` (in the folder ``native``) on ``path`` with ``streams`` slots; yields its URL."""
    port = _free_port()
    argv = [os.path.join(native, "llama-server"), "-m", path, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(streams), "-c", str(streams * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
            "--cont-batching", "--no-webui", "-b", "2048", "-ub", "512"]
    if not repack:
        argv.append("--no-repack")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "LD_LIBRARY_PATH": native})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, log_path, "llama-server", timeout_s=120)
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


@contextlib.contextmanager
def ours(path: str, variant: str, streams: int, ctx_per_slot: int, threads: int):
    """pagedserve on ``path`` with a KV pool of the tokens llama-server's ``-c`` holds (16-token blocks)."""
    quantization = "none" if variant == "bf16" else "gguf"
    blocks = streams * -(-ctx_per_slot // 16) + 16
    proc, url = start_server(["--model", path, "--dtype", "bfloat16", "--quantization", quantization,
                              "--max-num-seqs", str(max(streams, 8)), "--num-threads", str(threads),
                              "--block-size", "16", "--num-kv-blocks", str(blocks)], OURS_LOG)
    try:
        yield url, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def logged_weight_mib(log_path: str) -> float:
    """The weights' bytes the executors logged at "model loaded" (summed over ranks), in MiB."""
    total = 0
    with open(log_path) as f:
        for line in f:
            if '"model loaded"' in line and '"weight_bytes"' in line:
                total += json.loads(line)["weight_bytes"]
    return total / MIB


def measure(variant: str, embedded: str, streams: int, args) -> dict:
    llama_path = variant_file(args.peers_dir, embedded, variant)
    ours_path = embedded if variant == "bf16" else llama_path
    plen, olen = args.prompt_len, args.output_len
    workloads = [make_workload(streams, args.seed + r, 49152, (plen, plen), (olen, olen)) for r in range(args.rounds)]
    warmup = make_workload(streams, args.seed + WARMUP_SEED_OFFSET, 49152, (plen, plen),
                           (WARMUP_OUTPUT_TOKENS, WARMUP_OUTPUT_TOKENS))
    ctx = plen + olen + 64
    with ours(ours_path, variant, streams, ctx, args.threads) as (url_a, proc_a), \
            llama_server(llama_bin(args.peers_dir), llama_path, streams, ctx, args.threads,
                         args.llama_repack) as (url_b, proc_b):
        servers = [Server("pagedserve", url_a, served_model_name(url_a)),
                   Server("llama-server", url_b, served_model_name(url_b))]
        rounds = measure_rounds(servers, workloads, warmup)
        memory = {"pagedserve": (logged_weight_mib(OURS_LOG), tree_pss_mib(proc_a.pid)),
                  "llama-server": (os.path.getsize(llama_path) / MIB, tree_pss_mib(proc_b.pid))}
        return {"rounds": rounds, "file": os.path.basename(llama_path), "memory": memory}


def report(rows: list[tuple[str, int, dict]]) -> None:
    print(f"\n{cpu_description()}")
    print("| variant (llama.cpp file) | streams | pagedserve tok/s | llama-server tok/s | ratio (per-round median) "
          "| TTFT p50 pagedserve | TTFT p50 llama-server | weights MiB pagedserve / llama-server "
          "| PSS MiB pagedserve / llama-server |")
    print("|---|---|---|---|---|---|---|---|---|")
    for variant, streams, run in rows:
        rounds = run["rounds"]
        a = [r["pagedserve"]["output tokens/s"] for r in rounds]
        b = [r["llama-server"]["output tokens/s"] for r in rounds]
        ta = [r["pagedserve"]["median TTFT (s)"] for r in rounds]
        tb = [r["llama-server"]["median TTFT (s)"] for r in rounds]
        med = statistics.median
        (wa, pa), (wb, pb) = run["memory"]["pagedserve"], run["memory"]["llama-server"]
        print(f"| {variant} ({run['file']}) | {streams} | {med(a):.1f} | {med(b):.1f} "
              f"| {med([x / y for x, y in zip(a, b)]):.2f}x | {med(ta) * 1000:.0f} ms | {med(tb) * 1000:.0f} ms "
              f"| {wa:.0f} / {wb:.0f} | {pa:.0f} / {pb:.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="bf16,Q8_0,Q4_1,Q4_K")
    ap.add_argument("--streams", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers-dir", default=PEERS)
    ap.add_argument("--llama-repack", action="store_true", help="let llama-server repack weights (AMX/AVX-512 layouts)")
    args = ap.parse_args()
    from shared.model_source import resolve_model

    embedded = resolve_model(None, convert_gguf=False).where
    say(f"machine: {cpu_description()}")
    rows = []
    for variant in args.variants.split(","):
        if variant != "Q4_1" and variant not in LLAMA_TYPE:
            raise SystemExit(f"unknown variant {variant!r}: one of bf16, Q4_1, {', '.join(LLAMA_TYPE)}")
        for streams in (int(s) for s in args.streams.split(",")):
            say(f"== {variant}, {streams} stream(s)")
            rows.append((variant, streams, measure(variant, embedded, streams, args)))
            report(rows[-1:])
    report(rows)


if __name__ == "__main__":
    main()
