"""numpy views of the tensors that many kernel calls share, made once per tensor instead of once
per call.

A kernel call takes numpy arrays (``common.kernel_array``: a 16-bit tensor viewed as its bits,
then ``Tensor.numpy()``, about 1 us per tensor). Some tensors reach the kernels again and again
while they live: the KV pools and the norm weights for the whole run; a step's residual stream,
rotary tables, slot mapping, block tables and context lengths in each of the model's layers. A
decode step of SmolLM2 converted about 800 tensors, most of them these. ``live_array(tensor)``
converts such a tensor once and returns the same array while the tensor object lives: the entry
is keyed by the object's ``id`` and dropped by a weak-reference callback when the object dies (so
an id that CPython hands to a later object never finds a stale array, and the cache holds no
tensor alive). Tensors made fresh per call (a matmul's output) gain nothing here and keep using
``kernel_array``.

An in-place change to a cached tensor is seen by its array (they share memory); a tensor whose
storage is swapped under the same object (``tensor.set_``) is not, and nothing here does that.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from kernels.cpu.common import kernel_array

_arrays: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def live_array(tensor: torch.Tensor) -> np.ndarray:
    """``kernel_array(tensor)``, converted at the first call for this tensor object and reused
    while it lives."""
    key = id(tensor)
    hit = _arrays.get(key)
    if hit is not None and hit[0]() is tensor:
        return hit[1]
    array = kernel_array(tensor)
    _arrays[key] = (weakref.ref(tensor, lambda _ref, key=key: _forget(key, _ref)), array)
    return array


def _forget(key: int, ref: weakref.ref) -> None:
    hit = _arrays.get(key)
    if hit is not None and hit[0] is ref:
        del _arrays[key]


def num_live_arrays() -> int:
    """How many tensors have an array cached now (for tests)."""
    return len(_arrays)
