"""Yardsticks for ``loadtest.profile``: the matmul roofline of a step, and the frontend's CPU cost
per output token.

- ``matmul_roofline``: the time of one step's matmuls alone, ``nn.Linear`` (or oneDNN-packed) on the
  Hugging Face shapes (q, k, v, o, gate, up, down per layer, then the LM head on the sampled rows)
  in the model's dtype, each layer with weights of its own (as in the model, they do not stay in
  cache from one layer to the next); best of ``repeats`` runs of the whole chain.
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

    @property
    def total_s(self) -> float:
        return self.layers_s + self.lm_head_s


def layer_shapes(cfg) -> list[tuple[int, int]]:
    """(in_features, out_features) of one decoder layer's matmuls, in Hugging Face's order."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]


def matmul_roofline(cfg, dtype: torch.dtype, num_tokens: int, num_sampled: int,
                    repeats: int = 5, clock=time.perf_counter_ns, kernel: str = "torch") -> MatmulRoofline:
    """One step's matmuls alone: ``num_tokens`` rows through every layer, ``num_sampled`` rows
    through the LM head; ``clock`` in ns (wall, or CPU time). ``kernel``: what the engine multiplies
    with (``--linear-kernel``, ``services/executor/linear.py``): "torch" (``nn.Linear``), "onednn"
    (oneDNN-packed weights) or "numba"."""
    from torch import nn

    from services.executor.linear import PackedLinear, PairLinear

    wrap = {"torch": lambda linear: linear, "onednn": PackedLinear, "numba": PairLinear}[kernel]

    def make(in_f: int, out_f: int) -> nn.Module:
        return wrap(nn.Linear(in_f, out_f, bias=False, dtype=dtype))

    with torch.inference_mode():
        layers_ = [[make(in_f, out_f) for in_f, out_f in layer_shapes(cfg)] for _ in range(cfg.num_layers)]
        inputs = {n: torch.randn(num_tokens, n, dtype=dtype) for n in {s[0] for s in layer_shapes(cfg)}}
        head, head_in = make(cfg.hidden_size, cfg.vocab_size), torch.randn(num_sampled, cfg.hidden_size, dtype=dtype)

        def layers() -> None:
            for layer in layers_:
                for linear in layer:
                    linear(inputs[linear.in_features])

        return MatmulRoofline(_best_of(layers, repeats, clock), _best_of(lambda: head(head_in), repeats, clock))


def _best_of(fn, repeats: int, clock) -> float:
    """Seconds."""
    fn()  # warm-up: oneDNN picks and caches its kernels
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best / 1e9


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
