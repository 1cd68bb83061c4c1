"""Yardsticks for ``loadtest.profile.main``: the matmul roofline of a step, and the frontend's CPU cost
per output token.

- ``RooflinePasses``: one step's matmuls alone, ``nn.Linear`` (or oneDNN-packed, or the Numba
  kernel) on the Hugging Face shapes (q, k, v, o, gate, up, down per layer, then the LM head on the
  sampled rows) in the model's dtype, each layer with weights of its own (as in the model, they do
  not stay in cache from one layer to the next); built once, timed a pass at a time, so that a
  profile can time a pass right after each step (``roofline_of``: the best pass, and each step
  over the pass of its own moment). ``matmul_roofline``: the best of ``repeats`` passes.
- ``frontend_costs``: what the frontend spends per output token on realistic streams: decoding the
  scheduler's ``RequestOutputs`` frames (one per step), the incremental detokenizer (with stop
  strings) and the SSE chunks (chat shape, JSON, bytes); CPU nanoseconds per token. Socket writes
  are not included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from shared.messages import RequestOutput, RequestOutputs, decode, encode

# English prose, tokenized and cut into streams (the model's own greedy text would do as well; this
# one does not depend on the weights).
_TEXT = (
    "PagedAttention keeps the key and value cache in fixed-size blocks, much as an operating system "
    "keeps memory in pages. A sequence owns a table that maps its logical blocks to physical ones, "
    "so memory is taken one block at a time as the sequence grows and given back the moment it "
    "ends. Blocks can be shared between sequences that start with the same prompt, and a shared "
    "block is copied only when one of them writes into it. The scheduler batches every running "
    "sequence at each iteration, admits new requests while memory lasts, and preempts the newest "
    "ones when it runs out: their blocks are either swapped to host memory or freed and computed "
    "again later. Here is a short list: first, “quotes” and accents (café, naïve); second, code "
    "like `x = y[i] + 1`; third, numbers such as 3.14159 and 1,000,000. Thank you for asking!\n\n"
)


@dataclass(frozen=True)
class MatmulRoofline:
    layers_s: float  # the decoder layers' matmuls
    lm_head_s: float
    # per measured step, in order: the step's time over the roofline pass timed right after it (the
    # same minute of a machine whose speed moves); empty where the passes were timed apart
    paired_ratios: tuple[float, ...] = ()

    @property
    def total_s(self) -> float:
        return self.layers_s + self.lm_head_s


def layer_shapes(cfg) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's matmuls, in Hugging Face's order: q, k, v,
    o, then gate, up, down (OPT's MLP: fc1, fc2; ``ModelShape.mlp_matrices``)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = [(h, i)] * (cfg.mlp_matrices - 1) + [(i, h)]
    return [(h, q), (h, kv), (h, kv), (q, h), *mlp]


class RooflinePasses:
    """One step's matmuls alone: ``num_tokens`` rows through every layer, ``num_sampled`` rows
    through the LM head. ``kernel``: what the engine multiplies with (``--linear-kernel``,
    ``services/executor/linear.py``): "torch" (``nn.Linear``), "onednn" (oneDNN-packed weights) or
    "numba". Built (and run once, so that oneDNN picks and caches its kernels) on construction."""

    def __init__(self, cfg, dtype: torch.dtype, num_tokens: int, num_sampled: int,
                 kernel: str = "torch", device: torch.device | str = "cpu") -> None:
        from torch import nn

        from services.executor.linear import PackedLinear, PairLinear

        wrap = {"torch": lambda linear: linear, "onednn": PackedLinear, "numba": PairLinear}[kernel]

        def make(in_f: int, out_f: int) -> nn.Module:
            return wrap(nn.Linear(in_f, out_f, bias=False, dtype=dtype, device=device))

        with torch.inference_mode():
            self._layers = [[make(in_f, out_f) for in_f, out_f in layer_shapes(cfg)]
                            for _ in range(cfg.num_layers)]
            self._inputs = {n: torch.randn(num_tokens, n, dtype=dtype, device=device)
                            for n in {s[0] for s in layer_shapes(cfg)}}
            self._head = make(cfg.embedding_dim, cfg.vocab_size)
            self._head_in = torch.randn(num_sampled, cfg.embedding_dim, dtype=dtype, device=device)
        self.time_pass(time.perf_counter_ns)  # warm-up

    def time_pass(self, clock=time.perf_counter_ns) -> tuple[int, int]:
        """One pass: (ns of the layers' matmuls, ns of the LM head) by ``clock``."""
        with torch.inference_mode():
            start = clock()
            for layer in self._layers:
                for linear in layer:
                    linear(self._inputs[linear.in_features])
            middle = clock()
            self._head(self._head_in)
            return middle - start, clock() - middle


def roofline_of(passes: list[list[tuple[int, int]]], step_ns: list[int] | None = None) -> MatmulRoofline:
    """The best pass's layers and LM head (each the least of its passes) of ``passes`` (groups of
    ``RooflinePasses.time_pass`` results); with ``step_ns`` (one step's time per group, the group
    timed right after it), also each step over the best pass of its own group."""
    flat = [p for group in passes for p in group]
    ratios = ()
    if step_ns is not None:
        if len(step_ns) != len(passes):
            raise ValueError(f"{len(step_ns)} steps for {len(passes)} groups of roofline passes")
        ratios = tuple(step / min(a + b for a, b in group) for step, group in zip(step_ns, passes))
    return MatmulRoofline(min(a for a, _ in flat) / 1e9, min(b for _, b in flat) / 1e9, ratios)


def matmul_roofline(cfg, dtype: torch.dtype, num_tokens: int, num_sampled: int,
                    repeats: int = 5, clock=time.perf_counter_ns, kernel: str = "torch") -> MatmulRoofline:
    """The best of ``repeats`` passes of ``RooflinePasses`` (``clock`` in ns: wall, or CPU time)."""
    passes = RooflinePasses(cfg, dtype, num_tokens, num_sampled, kernel)
    return roofline_of([[passes.time_pass(clock) for _ in range(repeats)]])


def stream_token_ids(tokenizer, num_streams: int, num_tokens: int) -> list[list[int]]:
    """``num_streams`` streams of ``num_tokens`` token ids each, cut from ``_TEXT`` at different
    offsets."""
    ids = list(tokenizer.encode(_TEXT * (1 + 2 * num_tokens // 100), add_special_tokens=False))
    return [ids[(7 * s) % 100:][:num_tokens] for s in range(num_streams)]


def frontend_costs(tokenizer, num_streams: int = 16, num_tokens: int = 256) -> dict[str, float]:
    """CPU ns per output token of the frontend's per-token work, as the server does it at batch
    decode: one frame per step holding one token per stream. Keys: ``outputs``, ``detokenize``, ``sse``."""
    from services.frontend.detokenizer import IncrementalDetokenizer
    from services.frontend.responses import ChatShapes, sse_event

    streams = stream_token_ids(tokenizer, num_streams, num_tokens)
    detoks = [IncrementalDetokenizer(tokenizer, stop=["<|im_end|>", "\nUser:"]) for _ in streams]
    shapes = ChatShapes("chatcmpl-0123456789abcdef", int(time.time()), "SmolLM2-135M-Instruct")
    # one frame per step, one output per stream in it, as the scheduler sends a frontend its pass
    frames = [encode(RequestOutputs([RequestOutput(f"req-{s}", 0, [ids[pos]], num_prompt_tokens=100)
                                     for s, ids in enumerate(streams)])) for pos in range(num_tokens)]
    ns = {"outputs": 0, "detokenize": 0, "sse": 0}
    clock = time.perf_counter_ns
    for pos in range(num_tokens):
        t0 = clock()
        outputs = decode(frames[pos]).outputs
        ns["outputs"] += clock() - t0
        for detok, output in zip(detoks, outputs):
            t1 = clock()
            text = detok.add(output.new_token_ids)
            if pos == num_tokens - 1:
                text += detok.finish()
            t2 = clock()
            if text:
                sse_event(shapes.chunk(0, text, None))
            t3 = clock()
            ns["detokenize"] += t2 - t1
            ns["sse"] += t3 - t2
    num = num_streams * num_tokens
    return {k: v / num for k, v in ns.items()}


def median_parts(samples: list[dict[str, int]]) -> dict[str, float]:
    """Per key, the median over the steps (a key a step lacks counts as 0 there)."""
    keys = {k for s in samples for k in s}
    return {k: float(np.median([s.get(k, 0) for s in samples])) for k in keys}
