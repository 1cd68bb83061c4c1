"""The quantized matmul kernels on SmolLM2's own Q4_1 layer weights, against each other and torch's
int4 CPU kernel, at decode and prefill row counts: which one ``kernels/cpu/quant_matmul.py`` uses
from how many rows (``PREFILL_ROWS``).

    python -m loadtest.kernels.quant_matmul [--rows 1,4,8,16,32,128] [--rounds 7]

Per row count, each round times every kernel once over one decoder layer's four matmuls (qkv,
o, gate_up, down) in an order that alternates by round; prints the median per kernel in ms:

- ``numba rows``: the Numba pass over the blocks (``matmul_rows``);
- ``f32 tiles``: dequantized float32 tiles and torch's matmul (``matmul_tiles``);
- ``torch int4pack``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` on the same 4-bit values in
  torch's packing (``Int4Pack``), with ``(scale, minv + 8 scale)`` per group of 32 in bfloat16
  and x in bfloat16, as a bfloat16 model runs it (with float32 scales and x the same op took
  about 30x as long in one run, so float32 models keep the Numba pass).

``torch._weight_int8pack_mm`` takes one scale per output row: it does not apply to Q8_0's 32-input
blocks and is not timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from loadtest.common.machine_state import print_cpu


def main() -> None:
    from shared.cpu_threads import configure_cpu_threads

    print(configure_cpu_threads(None), file=sys.stderr)
    import torch

    from kernels.cpu.quant_matmul import Int4Pack, int4_matmul, matmul_rows, matmul_tiles
    from services.executor.loader import RunnerOptions, build_runner
    from services.executor.quantized import QuantLinear
    from services.executor.weights import load_hf_config, load_weights
    from shared.model_source import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,128")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print_cpu()
    source = resolve_model(None)
    config = load_hf_config(source)
    runner = build_runner(config, load_weights(source, config, "auto")[0],
                          RunnerOptions(dtype=torch.float32, num_kv_blocks=16, num_cpu_blocks=0))
    layer = [m for m in runner.model.model.layers[0].modules() if isinstance(m, QuantLinear)]
    packs = [p for m in layer for p in m.packs]
    int4 = [Int4Pack(p) for p in packs]
    for rows in (int(r) for r in args.rows.split(",")):
        if rows == int(args.rows.split(",")[0]):
            print("| rows | numba rows | f32 tiles | torch int4pack |")
            print("|---|---|---|---|")
        xs = [torch.randn(rows, p.in_features) for p in packs]
        xb = [x.bfloat16() for x in xs]  # the int4 kernel's input, as a bfloat16 model's
        kernels = {"numba rows": lambda: [matmul_rows(x, p) for x, p in zip(xs, packs)],
                   "f32 tiles": lambda: [matmul_tiles(x, p) for x, p in zip(xs, packs)],
                   "torch int4pack": lambda: [int4_matmul(x, p) for x, p in zip(xb, int4)]}
        times: dict[str, list[float]] = {k: [] for k in kernels}
        names = list(kernels)
        for r in range(args.rounds + 1):  # the first round warms up and is not counted
            for name in (names if r % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                kernels[name]()
                if r:
                    times[name].append((time.perf_counter() - t0) * 1e3)
        print(f"| {rows} | " + " | ".join(f"{statistics.median(times[k]):.3f}" for k in names) + " |", flush=True)


if __name__ == "__main__":
    main()
