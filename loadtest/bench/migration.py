"""Live migration between two replicas, in process (``services/offline_replicas.py``): the pause per
sequence and the bytes moved, against the time to recompute (prefill) the same sequence.

    python -m loadtest.bench.migration [--lengths 256 1024 2000]

Two offline engines on SmolLM2-135M (bfloat16 where the CPU has it), one new request per context
length and round on replica 0 (the first round of the first length compiles the kernels): its prefill is timed (the recompute a replay would pay), it decodes a few
tokens, then it migrates to replica 1. Pre-copy: the steps from ``migrate`` until the request is
paused (its full blocks written, and read by replica 1 into blocks it takes, while it decodes); pause: from then until replica 1 has read every
block and runs it (its last blocks written, the state moved, the files read and checked). The
greedy continuation is compared with an unmigrated run of the same prompt.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from loadtest.bench.throughput import say


def _engine(num_blocks: int):
    from services.offline import LLM

    return LLM(num_kv_blocks=num_blocks, max_num_batched_tokens=4096, dtype="auto").engine


def _request(rid: str, prompt: list[int], max_tokens: int):
    from shared.messages import AddRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return AddRequest(rid, np.array(prompt, np.int32), params, time.time())


def one(engine, length: int, seed: int, max_tokens: int = 16) -> dict:
    from services.scheduler.migration import Phase

    prompt = [int(t) for t in np.random.default_rng(seed).integers(100, 40000, length)]
    engine.add_request(_request(f"base{seed}", prompt, max_tokens))  # unmigrated, on replica 1
    base = [t for out in _drain(engine) for t in out.new_token_ids]
    engine.add_request(_request(f"m{seed}", prompt, max_tokens))
    t0 = time.perf_counter()
    tokens = [t for out in engine.step() for t in out.new_token_ids]  # the prefill and first token
    prefill_s = time.perf_counter() - t0
    for _ in range(3):
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    m = engine.migrate(f"m{seed}", 1)
    t0 = time.perf_counter()
    paused_at = None
    while m.phase not in (Phase.DONE, Phase.ABORTED):
        tokens += [t for out in engine.step() for t in out.new_token_ids]
        if paused_at is None and m.phase is not Phase.PRECOPY:
            paused_at = time.perf_counter()
    done_at = time.perf_counter()
    tokens += [t for out in _drain(engine) for t in out.new_token_ids]
    mover = engine.cores[0].runner._mover
    num_blocks = -(-(length + 3) // engine.cores[0].runner.block_size)
    return {"length": length, "prefill_ms": prefill_s * 1e3, "precopy_ms": (paused_at - t0) * 1e3,
            "pause_ms": (done_at - paused_at) * 1e3, "bytes": num_blocks * mover.payload_bytes,
            "phase": str(m.phase), "same": tokens == base}


def _drain(engine):
    outs = []
    while engine.has_work():
        outs += engine.step()
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2000])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from services.offline_replicas import ReplicatedEngine

    engine = ReplicatedEngine([_engine(400), _engine(400)])
    say("context | prefill (recompute) ms | pre-copy ms | pause ms | MiB moved | pause / prefill | same output")
    try:
        for length in args.lengths:
            for i in range(args.rounds):  # a new prompt each time: nothing from the prefix cache
                r = one(_Routed(engine), length, seed=length * 10 + i)
                say(f"{r['length']:7} | {r['prefill_ms']:24.1f} | {r['precopy_ms']:11.1f} | {r['pause_ms']:8.1f} | "
                    f"{r['bytes'] / 2**20:9.1f} | {r['pause_ms'] / r['prefill_ms']:15.3f}x | {r['same']} ({r['phase']})")
    finally:
        engine.close()


class _Routed:
    """The replicated engine, with base runs on replica 1 and migrated ones starting on replica 0."""

    def __init__(self, engine) -> None:
        self.e = engine
        self.cores = engine.cores

    def add_request(self, request) -> None:
        self.e.add_request(request, replica=1 if request.request_id.startswith("base") else 0)

    def __getattr__(self, name):
        return getattr(self.e, name)


if __name__ == "__main__":
    main()
