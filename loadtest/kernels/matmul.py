"""Matmul micro-benchmark of the ``--linear-kernel`` choices: ``python -m loadtest.kernels.matmul``.

One decode step's matmuls on SmolLM2-135M's shapes (30 decoder layers of q, k, v, o, gate, up,
down, each layer with weights of its own so that nothing stays in cache from one layer to the
next, then the tied LM head ``[576 -> 49,152]``), in bfloat16 by default, at several row counts
(the tokens of a step). For each row count the kernels run interleaved in one process (one whole
chain of each per round, the order alternating between rounds), because this machine kind's speed
moves by up to 2x within minutes: compare the ratios in one run, not times across runs. It prints
per row count the median ms of each kernel, its ratio to the first one named, and the GB/s at
which it read the weights (their bytes over its time). The kernels:

- ``numba``: ``kernels/cpu/matmul.py`` (bfloat16 only; on a CPU without AVX-512 BF16 its widening
  path, correct but not fast);
- ``onednn``: oneDNN-packed weights (``torch.ops.mkldnn``), what vLLM-CPU's linear layers use;
- ``torch``: ``nn.Linear`` (``F.linear``) on the plain weights.

Before timing, each kernel's output for one layer is checked against a float64 product of the same
bfloat16 values (at most a few bfloat16 steps apart): a fast wrong kernel is not a result.
``--layers`` and ``--vocab`` shrink the model (the tests run it that way).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

HIDDEN, INTERMEDIATE, Q_WIDTH, KV_WIDTH = 576, 1536, 576, 192  # SmolLM2-135M: 9 heads, 3 KV heads of 64
LAYERS, VOCAB = 30, 49152
ROWS = (1, 4, 8, 16, 32, 64)
KERNELS = ("numba", "onednn", "torch")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def layer_shapes() -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's matmuls, in Hugging Face's order."""
    h, i = HIDDEN, INTERMEDIATE
    return [(h, Q_WIDTH), (h, KV_WIDTH), (h, KV_WIDTH), (Q_WIDTH, h), (h, i), (h, i), (i, h)]


def wrapper(kernel: str):
    from services.executor.linear import PackedLinear, PairLinear

    return {"torch": lambda linear: linear, "onednn": PackedLinear, "numba": PairLinear}[kernel]


class Chain:
    """One kernel's copy of the step's matmuls (the same weights for every kernel)."""

    def __init__(self, kernel: str, linears: list[list[nn.Linear]], head: nn.Linear) -> None:
        wrap = wrapper(kernel)
        self.kernel = kernel
        self.layers = [[wrap(linear) for linear in layer] for layer in linears]
        self.head = wrap(head)

    def __call__(self, inputs: dict[int, torch.Tensor], head_in: torch.Tensor) -> None:
        for layer in self.layers:
            for linear in layer:
                linear(inputs[linear.in_features])
        self.head(head_in)


def make_linears(layers: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    """Random ``nn.Linear``s of SmolLM2's shapes (no bias, as in Llama), scaled as a trained
    model's (about unit outputs for unit inputs)."""
    generator = torch.Generator().manual_seed(seed)

    def linear(in_f: int, out_f: int) -> nn.Linear:
        layer = nn.Linear(in_f, out_f, bias=False, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(out_f, in_f, generator=generator) * in_f ** -0.5)
        return layer

    return [[linear(i, o) for i, o in layer_shapes()] for _ in range(layers)], linear(HIDDEN, vocab)


def check(chain: Chain, reference: nn.Linear, dtype: torch.dtype) -> float:
    """The largest difference between ``chain``'s first down projection and a float64 product of the
    same values, in units of the output's largest magnitude; raises if it exceeds a few 16-bit
    steps (or float32 rounding)."""
    x = torch.randn(5, reference.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = x.double() @ reference.weight.double().T
    got = chain.layers[0][-1](x).double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    bound = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
    if not err <= bound:
        raise RuntimeError(f"{chain.kernel}: relative error {err:.2e} above {bound:.0e}")
    return err


def weight_bytes(layers: int, vocab: int, dtype: torch.dtype) -> int:
    size = torch.tensor([], dtype=dtype).element_size()
    return size * (layers * sum(i * o for i, o in layer_shapes()) + HIDDEN * vocab)


def measure(chains: list[Chain], rows: int, rounds: int, dtype: torch.dtype) -> list[float]:
    """Median seconds of each chain at ``rows`` rows, interleaved (the order alternating per round)."""
    generator = torch.Generator().manual_seed(rows)
    inputs = {n: torch.randn(rows, n, generator=generator).to(dtype) for n in (HIDDEN, INTERMEDIATE)}
    head_in = inputs[HIDDEN]
    for chain in chains:  # warm-up: oneDNN picks its kernels, numba its specializations
        chain(inputs, head_in)
    times: list[list[float]] = [[] for _ in chains]
    for r in range(rounds):
        order = list(range(len(chains)))
        if r % 2:
            order.reverse()
        for k in order:
            start = time.perf_counter()
            chains[k](inputs, head_in)
            times[k].append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.kernels.matmul", description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", default="numba,onednn",
                        help=f"comma-separated, the first is the baseline of the ratios ({', '.join(KERNELS)})")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    parser.add_argument("--rounds", type=int, default=5, help="timed chains per kernel and row count")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch and numba threads (default: torch.get_num_threads())")
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (SmolLM2: 30)")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="LM head outputs (SmolLM2: 49,152)")
    args = parser.parse_args(argv)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not kernels or any(k not in KERNELS for k in kernels) or len(set(kernels)) != len(kernels):
        parser.error(f"--kernels must name some of {', '.join(KERNELS)} once each; got {args.kernels!r}")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        parser.error(f"--rows must be positive integers, comma-separated; got {args.rows!r}")
    if args.rounds < 1 or args.layers < 1 or args.vocab < 1:
        parser.error("--rounds, --layers and --vocab must be at least 1")
    dtype = _DTYPES[args.dtype]
    if "numba" in kernels and dtype != torch.bfloat16:
        parser.error("the numba kernel multiplies bfloat16 only")

    import numba

    from shared.cpu_features import read_cpu_features

    threads = min(args.threads or torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    features = read_cpu_features()
    print(f"CPU: {features.model_name or 'unknown'}; native 16-bit matmuls: "
          f"{features.native_bf16() or 'none'}; threads {threads}", flush=True)
    total = weight_bytes(args.layers, args.vocab, dtype)
    print(f"{args.layers} layers of {len(layer_shapes())} matmuls + LM head [{HIDDEN} -> {args.vocab}], "
          f"{args.dtype}: {total / 1e6:.0f} MB of weights per step", flush=True)

    t0 = time.perf_counter()
    print("building and packing the weights, compiling the kernels (cached after the first run)...",
          flush=True)
    linears, head = make_linears(args.layers, args.vocab, dtype)
    chains = []
    for kernel in kernels:
        with torch.inference_mode():
            chain = Chain(kernel, linears, head)
            err = check(chain, linears[0][-1], dtype)
        chains.append(chain)
        print(f"  {kernel}: ready, relative error vs float64 {err:.1e}", flush=True)
    del linears, head
    print(f"  done in {time.perf_counter() - t0:.1f} s", flush=True)

    base = kernels[0]
    header = " ".join(f"{k + ' ms':>11}" for k in kernels)
    ratios = " ".join(f"{k + '/' + base:>15}" for k in kernels[1:])
    speeds = " ".join(f"{k + ' GB/s':>12}" for k in kernels)
    print(f"\n{'rows':>5} | {header} | {ratios} | {speeds}", flush=True)
    with torch.inference_mode():
        for n in rows:
            secs = measure(chains, n, args.rounds, dtype)
            cells = " ".join(f"{s * 1e3:>11.2f}" for s in secs)
            rel = " ".join(f"{s / secs[0]:>15.2f}" for s in secs[1:])
            gbs = " ".join(f"{total / s / 1e9:>12.1f}" for s in secs)
            print(f"{n:>5} | {cells} | {rel} | {gbs}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
