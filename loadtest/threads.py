"""How many CPU threads, and which OpenMP wait policy, for the executor's decode steps.

    python -m loadtest.threads [--steps 20] [--batch 32] [--context 256]

Times SmolLM2 decode steps (the executor's own model code and Numba kernels) in a fresh process
per setting, alone and next to a busy neighbour process (standing in for the frontend and the
scheduler, which share the machine), and prints the median step time and the ratio to the best.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = [
    ("1 thread", {"PAGEDSERVE_NUM_THREADS": "1"}),
    ("2 threads, OMP default wait", {"PAGEDSERVE_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}),
    ("2 threads, OMP_WAIT_POLICY=PASSIVE", {"PAGEDSERVE_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}),
]


def _worker(steps: int, batch: int, context: int) -> None:
    """Runs in the child: build SmolLM2 over a paged cache, time decode steps, print JSON."""
    import numpy as np
    import torch

    from services.executor.attention import select_backend
    from services.executor.model import ModelConfig
    from services.executor.runner import ModelRunner, allocate_kv_cache
    from services.executor.weights import build_model, load_hf_config, load_state_dict
    from shared.messages import NewSequence, SamplingParams, Step
    from shared.model_source import resolve_model
    from shared.threads import configure_cpu_threads

    threads = configure_cpu_threads(None)
    src = resolve_model(None)
    hf = load_hf_config(src)
    model = build_model(hf, load_state_dict(src), torch.float32, torch.device("cpu"), 2048)
    cfg = ModelConfig.from_hf(hf)
    bs = 16
    per_seq = -(-(context + steps + 1) // bs)
    kv = allocate_kv_cache(cfg, batch * per_seq, bs, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, kv, select_backend("auto", torch.device("cpu")), torch.device("cpu"))
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    greedy = SamplingParams(temperature=0.0)
    times = []
    for i in range(steps + 2):
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
        t0 = time.perf_counter()
        runner.execute(step)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"threads": threads, "median_s": statistics.median(times[2:])}))


def _neighbour() -> subprocess.Popen:
    """A process that keeps one core partly busy, as the frontend and scheduler do under load."""
    code = "import time\nwhile True:\n    t=time.perf_counter()\n    while time.perf_counter()-t<0.002: pass\n    time.sleep(0.001)\n"
    return subprocess.Popen([sys.executable, "-c", code])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.steps, args.batch, args.context)
        return
    rows = []
    for neighbour in (False, True):
        for name, env in SETTINGS:
            label = f"{name}{' + busy neighbour' if neighbour else ''}"
            print(f"measuring: {label} ...", flush=True)
            other = _neighbour() if neighbour else None
            try:
                out = subprocess.run(
                    [sys.executable, "-m", "loadtest.threads", "--worker", "--steps", str(args.steps),
                     "--batch", str(args.batch), "--context", str(args.context)],
                    env={**os.environ, **env}, capture_output=True, text=True, check=True,
                )
            finally:
                if other:
                    other.kill()
                    other.wait()
            rows.append((label, json.loads(out.stdout.strip().splitlines()[-1])["median_s"]))
    best = min(t for _, t in rows)
    print(f"\nSmolLM2 decode step, batch {args.batch}, context {args.context}, median of {args.steps}:")
    for label, t in rows:
        print(f"  {label:52} {t * 1000:8.1f} ms   x{t / best:.2f}")


if __name__ == "__main__":
    main()
