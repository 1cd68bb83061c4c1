"""Random GGUF quantized weights for the kernel tests: quantized by the ``gguf`` package where it
can (Q8_0, Q4_0, Q4_1), random block bytes with sane float16 scales where it cannot (Q4_K, Q6_K:
``gguf.quants.quantize`` has no quantizer for them, only their dequantizer)."""

from __future__ import annotations

import numpy as np

from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

QUANTIZABLE = (T.Q8_0, T.Q4_0, T.Q4_1)
SERVED = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K)
_HALF_FIELDS = {T.Q4_K: (0, 2), T.Q6_K: (208,)}  # byte offsets of each block's float16 scales
_BLOCK = {T.Q4_K: (256, 144), T.Q6_K: (256, 210)}


def random_quantized(qtype, rows: int, cols: int, seed: int = 0, weights: np.ndarray | None = None) -> np.ndarray:
    """uint8 ``[rows, cols / block * block bytes]``: ``rows`` x ``cols`` weights of ``qtype``
    (``weights`` quantized where the gguf package can, else random normal ones; random blocks for
    the types it cannot quantize, their weights below about 0.5 in size)."""
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        w = rng.standard_normal((rows, cols)) if weights is None else weights
        return quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)
    block, nbytes = _BLOCK[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    for off in _HALF_FIELDS[qtype]:
        half = (rng.random((rows, cols // block)) * 2e-4 + 1e-4).astype(np.float16)
        raw[..., off:off + 2] = half.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)
