"""How many CPU threads, and which OpenMP wait policy, for the executor's decode steps.

    python -m loadtest.profile.thread_settings [--dtype auto] [--steps 12] [--batch 32] [--context 256] [--rounds 2]

Times SmolLM2 decode steps (the executor's own model code and Numba kernels) in a fresh process
per setting (threads, one or separate OpenMP runtimes for torch and Numba, and how their idle
threads wait are fixed once, when the runtime loads; ``shared/cpu_threads.py``): alone, next to a
light neighbour (busy 1 ms in 10, like a frontend streaming a few dozen requests) and next to a
heavy one (busy 2 ms in 3). Settings and neighbours are interleaved over ``--rounds``; it prints
the median step time (wall) and the process's CPU time per step, and the ratio to the best
setting of the same neighbour. The weights are read once and handed to the workers in a
temporary file, so that a setting costs seconds, not a model load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# (label, environment) as a user would set them; "" unsets. Every setting names every variable, so
# that the caller's own environment does not leak into one.
_UNSET = {"OMP_WAIT_POLICY": "", "GOMP_SPINCOUNT": "", "PAGEDSERVE_SHARE_OPENMP": ""}
SETTINGS = [
    ("1 thread", {**_UNSET, "PAGEDSERVE_NUM_THREADS": "1"}),
    ("separate runtimes, PASSIVE", {**_UNSET, "PAGEDSERVE_NUM_THREADS": "0", "PAGEDSERVE_SHARE_OPENMP": "0"}),
    ("separate runtimes, GOMP_SPINCOUNT=200000",
     {**_UNSET, "PAGEDSERVE_NUM_THREADS": "0", "PAGEDSERVE_SHARE_OPENMP": "0", "GOMP_SPINCOUNT": "200000"}),
    ("one runtime, PASSIVE", {**_UNSET, "PAGEDSERVE_NUM_THREADS": "0", "OMP_WAIT_POLICY": "PASSIVE"}),
    ("one runtime, GOMP_SPINCOUNT=200000 (the rule)", {**_UNSET, "PAGEDSERVE_NUM_THREADS": "0"}),
    ("one runtime, ACTIVE", {**_UNSET, "PAGEDSERVE_NUM_THREADS": "0", "OMP_WAIT_POLICY": "ACTIVE"}),
]
NEIGHBOURS = {"alone": None, "light neighbour": (0.001, 0.009), "heavy neighbour": (0.002, 0.001)}


def _worker(args) -> None:
    """Runs in the child: SmolLM2 over a paged cache of noise, timed decode steps, JSON out."""
    for name in _UNSET:
        if os.environ.get(name) == "":
            del os.environ[name]
    threads = int(os.environ.get("PAGEDSERVE_NUM_THREADS", 0)) or os.cpu_count() or 1
    from shared.openmp import loaded_runtimes
    from shared.cpu_threads import configure_cpu_threads

    choice = configure_cpu_threads(threads)  # as the executor does, in this setting's environment
    import numpy as np
    import torch

    from services.executor.attention import select_backend
    from services.executor.architectures import model_config
    from services.executor.runner import ModelRunner, allocate_kv_cache
    from services.executor.weights import build_model, load_hf_config, resolve_dtype
    from shared.messages import NewSequence, SamplingParams, Step
    from shared.model_source import resolve_model

    dtype = resolve_dtype(args.dtype, torch.device("cpu")).dtype
    hf = load_hf_config(resolve_model(None))
    model = build_model(hf, torch.load(args.weights, mmap=True), dtype, torch.device("cpu"), 2048)
    cfg = model_config(hf)
    batch, context, bs = args.batch, args.context, 16
    per_seq = -(-(context + args.steps + 3) // bs)
    kv = allocate_kv_cache(cfg, batch * per_seq, bs, dtype, torch.device("cpu"))
    for k, v in kv:
        k.normal_()
        v.normal_()
    runner = ModelRunner(model, kv, select_backend("auto", torch.device("cpu")), torch.device("cpu"))
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    greedy = SamplingParams(temperature=0.0)
    wall, cpu = [], []
    for i in range(args.steps + 2):
        pos = context + i
        step = Step(
            step_id=i, num_decodes=batch, seq_ids=np.arange(batch, dtype=np.int64),
            input_token_ids=np.full(batch, 42, np.int64), positions=np.full(batch, pos, np.int64),
            slot_mapping=(tables[:, pos // bs] * bs + pos % bs).astype(np.int64),
            query_start_loc=np.arange(batch + 1, dtype=np.int32),
            context_lens=np.full(batch, pos + 1, np.int32), block_tables=tables,
            sample_mask=np.ones(batch, bool),
            new_seqs=[NewSequence(s, f"r{s}", greedy, np.full(context, 42, np.int32), context)
                      for s in range(batch)] if i == 0 else [],
        )
        t0, c0 = time.perf_counter(), time.process_time()
        runner.execute(step)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    print(json.dumps({"threads": threads, "dtype": str(dtype), "wall_s": statistics.median(wall[2:]),
                      "cpu_s": statistics.median(cpu[2:]), "openmp": choice.openmp,
                      "runtimes": len(loaded_runtimes())}))


def _neighbour(busy_s: float, idle_s: float) -> subprocess.Popen:
    """A process that keeps one core busy ``busy_s`` out of every ``busy_s + idle_s`` seconds."""
    code = ("import time\nwhile True:\n    t=time.perf_counter()\n"
            f"    while time.perf_counter()-t<{busy_s}: pass\n    time.sleep({idle_s})\n")
    return subprocess.Popen([sys.executable, "-c", code])


def _run(args, env: dict, neighbour) -> dict:
    other = _neighbour(*neighbour) if neighbour else None
    try:
        out = subprocess.run(
            [sys.executable, "-m", "loadtest.profile.thread_settings", "--worker", "--weights", args.weights, "--dtype", args.dtype,
             "--steps", str(args.steps), "--batch", str(args.batch), "--context", str(args.context)],
            env={**os.environ, **env}, capture_output=True, text=True, check=True,
        )
    finally:
        if other:
            other.kill()
            other.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2, help="repeats of every (setting, neighbour), interleaved")
    ap.add_argument("--neighbours", default=",".join(NEIGHBOURS), help=f"comma-separated, of {list(NEIGHBOURS)}")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--weights", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    from shared.cpu_threads import set_thread_env

    set_thread_env()
    import torch

    from services.executor.weights import load_state_dict
    from shared.model_source import resolve_model

    print("reading the weights once ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="pagedserve-threads-") as tmp:
        args.weights = os.path.join(tmp, "weights.pt")
        torch.save(load_state_dict(resolve_model(None)), args.weights)
        results: dict[tuple[str, str], list[dict]] = {}
        for round_idx in range(args.rounds):
            for neighbour in args.neighbours.split(","):
                for name, env in SETTINGS if round_idx % 2 == 0 else SETTINGS[::-1]:
                    print(f"round {round_idx + 1}/{args.rounds}: {name}, {neighbour} ...", flush=True)
                    results.setdefault((neighbour, name), []).append(_run(args, env, NEIGHBOURS[neighbour]))
    _report(args, results)


def _report(args, results: dict) -> None:
    first = next(iter(results.values()))[0]
    print(f"\nSmolLM2 decode step in {first['dtype']}, batch {args.batch}, context {args.context}; median of "
          f"{args.steps} steps, then of {args.rounds} rounds; {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}")
    for neighbour in args.neighbours.split(","):
        rows = {name: runs for (n, name), runs in results.items() if n == neighbour}
        walls = {name: statistics.median(r["wall_s"] for r in runs) for name, runs in rows.items()}
        best = min(walls.values())
        print(f"  {neighbour}:")
        for name, runs in rows.items():
            cpu = statistics.median(r["cpu_s"] for r in runs)
            print(f"    {name:48} {runs[0]['threads']} threads  {walls[name] * 1e3:8.1f} ms wall  "
                  f"{cpu * 1e3:8.1f} ms CPU   x{walls[name] / best:.2f}   "
                  f"{runs[0]['runtimes']} OpenMP runtime(s) loaded")


if __name__ == "__main__":
    main()
