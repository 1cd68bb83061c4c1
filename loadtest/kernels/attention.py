"""Decode micro-benchmark of the paged kernels: ``python -m loadtest.kernels.attention [--quick] [--ptxas]``.

SmolLM2 decode shapes (9 query heads, 3 KV heads, head_dim 64, block size 16), for float32 and
bfloat16 caches (``--dtypes``; queries and outputs in the cache's dtype, as the model runs). Every
sequence of a batch has the same context length, so the contiguous baseline (torch SDPA over a
``[batch, kv_heads, context, head_dim]`` cache of the same dtype, no mask, grouped-query) does no
padding work: it is the best case a paged kernel competes against. Block tables are random
permutations of the pool (a fragmented cache). For each shape it prints the median time of the
Numba CPU paged kernel, of SDPA over the contiguous cache and of the PyTorch paged reference
(``kernels/reference.py``), with ratios; the last lines are ``paged/contiguous (DTYPE): X.XX`` for
batch 32, context 1,024, one per dtype. With a CUDA device (``torch.cuda.is_available()``) the
Numba CUDA kernels are measured the same way, before them, in the same dtypes (their own last
lines: ``CUDA paged/contiguous (DTYPE)``); ``--no-cpu`` measures only them.

Both sides run with the same thread count: ``--threads`` (default ``torch.get_num_threads()``) is
given to ``torch.set_num_threads`` and ``numba.set_num_threads``.

``--ptxas`` prints, instead, the resources of every Numba CUDA kernel as ``ptxas`` assembles it
for sm_80 and sm_90 (``kernels/cuda/resources.py``): registers, spills, shared memory and the
occupancy they allow at the launch configuration used. It needs NVVM and ``ptxas``, not a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kernels import reference
from loadtest.common.machine_state import print_cpu

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
BATCHES = (1, 8, 32, 64)
CONTEXTS = (128, 256, 512, 1024, 2048)
QUICK_BATCHES = (1, 32)
QUICK_CONTEXTS = (256, 1024)
KEY_SHAPE = (32, 1024)  # the shape of the last line


def _medians_ms(fns, sync=lambda: None, budget_s: float = 0.5, min_rounds: int = 5,
                max_rounds: int = 200) -> list[float]:
    """Median ms of each function, run round-robin (one call of each per round) so that a change
    in the machine's load touches them alike; rounds go on until ``budget_s`` has passed."""
    for fn in fns:  # warm-up (and compilation)
        fn()
    sync()
    times = [[] for _ in fns]
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (rounds < max_rounds and time.perf_counter() - start < budget_s):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        rounds += 1
    return [statistics.median(ts) * 1e3 for ts in times]


def _make_case(batch: int, context: int, device: str, generator: torch.Generator,
               dtype: torch.dtype = torch.float32):
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq

    def randn(*shape):
        return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)

    key_cache = randn(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    value_cache = randn(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    block_tables = torch.randperm(num_blocks, generator=generator).view(batch, blocks_per_seq)
    block_tables = block_tables.to(torch.int32).to(device)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = randn(batch, NUM_HEADS, HEAD_DIM)
    # the contiguous baseline: the same keys/values, already gathered and padded
    contiguous_k = randn(batch, NUM_KV_HEADS, context, HEAD_DIM)
    contiguous_v = randn(batch, NUM_KV_HEADS, context, HEAD_DIM)
    return key_cache, value_cache, block_tables, context_lens, query, contiguous_k, contiguous_v


def _run(label: str, backend, device: str, shapes, budget_s: float,
         dtype: torch.dtype = torch.float32) -> float | None:
    scale = HEAD_DIM ** -0.5
    generator = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    print(f"\n[{label}, {str(dtype).removeprefix('torch.')} caches] median ms per decode call "
          "(one layer)", flush=True)
    print(f"{'batch':>5} {'context':>7} | {'paged':>8} {'contig':>8} {'reference':>9} | "
          f"{'paged/contig':>12} {'paged/ref':>9}", flush=True)
    key_ratio = None
    for batch, context in shapes:
        kc, vc, bt, lens, q, ck, cv = _make_case(batch, context, device, generator, dtype)
        out = torch.empty_like(q)
        q4 = q.unsqueeze(2)
        ref_out = torch.empty_like(q)
        # the two contenders alternate; the (much slower) reference runs on its own
        t_paged, t_contig = _medians_ms([
            lambda: backend.decode(out, q, kc, vc, bt, lens, scale),
            lambda: F.scaled_dot_product_attention(q4, ck, cv, scale=scale, enable_gqa=True),
        ], sync, budget_s)
        (t_ref,) = _medians_ms(
            [lambda: reference.paged_decode_attention(ref_out, q, kc, vc, bt, lens, scale)], sync,
            budget_s / 4, min_rounds=3)
        err = (out.float() - ref_out.float()).abs().max().item()
        print(f"{batch:>5} {context:>7} | {t_paged:>8.3f} {t_contig:>8.3f} {t_ref:>9.3f} | "
              f"{t_paged / t_contig:>12.2f} {t_paged / t_ref:>9.2f}   (max |err| {err:.1e})",
              flush=True)
        if (batch, context) == KEY_SHAPE:
            key_ratio = t_paged / t_contig
        del kc, vc, ck, cv
    return key_ratio


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cpu_backend(threads: int):
    import numba

    print("compiling the Numba CPU kernels (cached after the first run)...", flush=True)
    t0 = time.perf_counter()
    from services.executor.attention import select_backend

    backend = select_backend("numba", torch.device("cpu"))  # as the executor builds it
    kc, vc, bt, lens, q, _, _ = _make_case(1, 64, "cpu", torch.Generator().manual_seed(1))
    backend.decode(torch.empty_like(q), q, kc, vc, bt, lens, 0.125)
    torch.set_num_threads(threads)  # the backend follows torch's count; keep ours
    print(f"  ready in {time.perf_counter() - t0:.1f} s; threads: torch {torch.get_num_threads()}, "
          f"numba {numba.get_num_threads()} (threading layer {numba.threading_layer()})", flush=True)
    return backend


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.kernels.attention", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 shapes instead of 20")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch and numba threads (default: torch.get_num_threads())")
    parser.add_argument("--budget", type=float, default=0.5,
                        help="seconds of timing per shape (at least 5 rounds)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="cache dtypes, comma-separated (float32, bfloat16, float16)")
    parser.add_argument("--no-cuda", action="store_true", help="skip the CUDA kernels")
    parser.add_argument("--no-cpu", action="store_true", help="skip the CPU kernels (on a GPU machine)")
    parser.add_argument("--ptxas", action="store_true",
                        help="print the CUDA kernels' registers, spills, shared memory, occupancy")
    args = parser.parse_args(argv)
    print_cpu()
    if args.ptxas:
        from kernels.cuda.resources import main as ptxas_main

        return ptxas_main()
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    if not dtypes or any(d not in _DTYPES for d in dtypes):
        parser.error(f"--dtypes must name some of {', '.join(_DTYPES)}; got {args.dtypes!r}")

    batches, contexts = (QUICK_BATCHES, QUICK_CONTEXTS) if args.quick else (BATCHES, CONTEXTS)
    shapes = [(b, c) for b in batches for c in contexts if (b, c) != KEY_SHAPE] + [KEY_SHAPE]

    import numba

    threads = args.threads or torch.get_num_threads()
    threads = min(threads, numba.config.NUMBA_NUM_THREADS)
    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    print(f"shapes: {NUM_HEADS} query heads, {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, "
          f"block size {BLOCK_SIZE}, caches {', '.join(dtypes)}; {len(shapes)} (batch, context) "
          "pairs", flush=True)

    if args.no_cpu and (args.no_cuda or not torch.cuda.is_available()):
        parser.error("--no-cpu leaves nothing to measure without a CUDA device (or with --no-cuda)")
    if torch.cuda.is_available() and not args.no_cuda:
        from kernels.cuda import NumbaCUDABackend

        print(f"CUDA: {torch.cuda.get_device_name()}; compiling the Numba CUDA kernels...", flush=True)
        cuda_backend = NumbaCUDABackend()
        cuda_ratios = {d: _run("numba CUDA vs torch CUDA", cuda_backend, "cuda", shapes, args.budget, _DTYPES[d])
                       for d in dtypes}
        for d, ratio in cuda_ratios.items():
            print(f"CUDA paged/contiguous ({d}): {ratio:.2f}", flush=True)

    if args.no_cpu:
        return 0
    backend = _cpu_backend(threads)
    key_ratios = {d: _run("numba CPU vs torch CPU", backend, "cpu", shapes, args.budget, _DTYPES[d])
                  for d in dtypes}
    for d, ratio in key_ratios.items():
        print(f"paged/contiguous ({d}): {ratio:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
