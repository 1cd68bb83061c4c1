"""Latency of the shared-memory all-reduce against torch.distributed (gloo), 2 ranks on this host.

    python -m loadtest.kernels.allreduce [--calls 2000] [--large-calls 200] [--world-size 2] [--policies]

One group of rank processes (one torch thread each) holds both communicators, a gloo group and a
shared-memory group, and all-reduces in place float32 tensors of the decode-path shapes
``[1, 576]`` and ``[64, 576]`` and a prefill-sized ``[2048, 576]``. The implementations take turns
in blocks of calls, so that both see the same machine load (it matters on a shared machine), and
rank 0 times every call after a warm-up. Prints the median and 90th percentile per shape and the
ratio to gloo (the target for shared memory: at most 0.5 on the two small shapes).
``--policies`` adds other wait policies (yield at once, longer spins, spin only) against the
default (spin 20 µs, then yield), to show what spinning costs when ranks share cores (try
``--world-size 3`` on a 2-core machine).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import socket
import statistics
import tempfile
import time

import msgpack
from loadtest.common.machine_state import print_cpu

SHAPES = [(1, 576), (64, 576), (2048, 576)]
POLICIES = {  # label -> WaitPolicy fields; "shm" is the product's default (spin 20 µs, then yield)
    "shm": {},
    "shm, yield at once": {"spin_s": 0.0},
    "shm, spin 200 µs": {"spin_s": 2e-4},
    "shm, spin 2 ms": {"spin_s": 2e-3},
    "shm, spin only": {"spin_s": 10.0},
}
NUM_ROUNDS = 10  # each implementation runs calls / NUM_ROUNDS calls per turn


def say(msg: str) -> None:
    print(msg, flush=True)


def _connect(rank: int, world_size: int, spec: dict):
    from services.executor.parallel.group import GroupConfig, open_group

    common = {"rank": rank, "world_size": world_size, "group_id": spec["group_id"], "store_path": spec["store_path"],
              "dist_init_addr": f"127.0.0.1:{spec['port']}"}
    return open_group(GroupConfig(all_reduce="torch", **common)), open_group(GroupConfig(all_reduce="shm", **common))


def _time_calls(comm, x, num_calls: int, times: list[float]) -> None:
    clock, scale = time.perf_counter, 1.0 / comm.world_size
    for _ in range(num_calls):
        start = clock()
        comm.all_reduce_(x)
        times.append(clock() - start)
        x.mul_(scale)  # keeps the values bounded, outside the timed call


def _rank_main(rank: int, world_size: int, spec: dict, labels: list[str], calls: dict, pipe) -> None:
    import torch

    from services.executor.parallel.peer_flags import WaitPolicy

    torch.set_num_threads(1)
    gloo, shm = _connect(rank, world_size, spec)
    timings: dict[str, dict[str, list[float]]] = {label: {} for label in labels}
    for shape in SHAPES:
        x = torch.randn(shape)
        per_turn = max(1, calls[shape] // NUM_ROUNDS)
        for label in labels:  # warm-up
            _time_calls(gloo if label == "gloo" else shm, x, max(10, per_turn // 5), [])
        for _ in range(NUM_ROUNDS):
            for label in labels:
                if label != "gloo":
                    shm.set_wait_policy(WaitPolicy(**POLICIES[label]))
                gloo.barrier()
                _time_calls(gloo if label == "gloo" else shm, x, per_turn,
                            timings[label].setdefault(str(list(shape)), []))
    shm.close()
    gloo.close()
    if rank == 0:
        pipe.send_bytes(msgpack.packb(timings))
    pipe.close()


def run_group(world_size: int, labels: list[str], calls: dict) -> dict[str, dict[str, list[float]]]:
    """Rank 0's call times (seconds): label -> shape -> times."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"port": port, "group_id": secrets.token_hex(6), "store_path": os.path.join(tmp, "store")}
        ctx = multiprocessing.get_context("fork")
        receiver, sender = ctx.Pipe(duplex=False)
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, spec, labels, calls, sender))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        sender.close()
        timings = msgpack.unpackb(receiver.recv_bytes())
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"a rank exited with {[p.exitcode for p in procs]}")
    return timings


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per small shape and implementation")
    ap.add_argument("--large-calls", type=int, default=200, help="timed calls for [2048, 576]")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--policies", action="store_true", help="also time fixed wait policies")
    args = ap.parse_args(argv)
    print_cpu()
    calls = {shape: args.large_calls if shape[0] > 64 else args.calls for shape in SHAPES}
    labels = ["gloo", *(POLICIES if args.policies else ["shm"])]
    say(f"timing {', '.join(labels)} with {args.world_size} ranks...")
    results = run_group(args.world_size, labels, calls)
    median = {label: {k: statistics.median(t) for k, t in shapes.items()} for label, shapes in results.items()}
    say(f"\nall-reduce, {args.world_size} ranks, float32, in place; rank 0's latency in µs: median (p90)")
    say(f"{'implementation':<22}" + "".join(f"{str(list(s)):>22}" for s in SHAPES))
    for label in labels:
        cells = [f"{median[label][k] * 1e6:9.1f} ({statistics.quantiles(t, n=10)[8] * 1e6:8.1f})"
                 for k, t in results[label].items()]
        say(f"{label:<22}" + "".join(f"{c:>22}" for c in cells))
    say("\nratio of medians to gloo (target for shm: <= 0.5 on the two small shapes)")
    for label in labels[1:]:
        say(f"{label:<22}" + "".join(f"{median[label][k] / median['gloo'][k]:>22.2f}" for k in median["gloo"]))
    small = [median["shm"][str(list(s))] / median["gloo"][str(list(s))] for s in SHAPES[:2]]
    say(f"\ntarget {'met' if max(small) <= 0.5 else 'NOT met'}: shm / gloo = " + ", ".join(f"{r:.2f}" for r in small))


if __name__ == "__main__":
    main()
