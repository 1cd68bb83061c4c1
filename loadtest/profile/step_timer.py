"""Where an executor step's time goes: timing wrappers installed on a ``ModelRunner`` from outside.

The product carries no timing code: ``install`` replaces, on the instances only, the methods whose
time it measures (``nn.Module.forward`` of every linear layer, norm and the rotary embedding, the
attention backend's kernels, the sampler, the runner's ``execute``) with wrappers that add their
time (``time.perf_counter_ns``, or the process's CPU time) to a category; ``uninstall`` puts the class methods back. A wrapper costs
well under a microsecond; a SmolLM2 step makes a few hundred wrapped calls.

Categories (ns, summed over the steps timed; ``breakdown`` derives the rest):

- ``matmul``: the linear layers of the forward pass (q/k/v/o, gate/up/down, fused or not; also
  the MLP's ``separate_gate_up``, its two matmuls in the float32 exactness mode; OPT's out_proj,
  fc1, fc2 and width projections), not the LM head;
- ``attention``: the backend's ``write_kv``, ``decode`` and ``prefill`` (the paged kernels), and
  ``decode_qkv`` (a decode-only step's rotary embedding, cache write and attention in one kernel:
  there ``rotary`` counts nothing; the numba backend's is its view of the pass, ``for_pass``);
- ``norm``, ``rotary``: the RMSNorm modules (also the final one; OPT's LayerNorms) and the rotary
  embedding (Llama's; OPT's learned positions are in ``other_layer``);
- ``forward``: the whole forward pass; ``lm_head``: ``compute_logits``; ``sampling``: the
  sampler; ``execute``: the runner's whole step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable

from torch import nn

EXECUTOR_PARTS = (
    ("matmul", "matmuls q/k/v/o, gate/up/down"),
    ("attention", "attention (paged kernels, cache write; decode: and rotary)"),
    ("norm", "norms (RMSNorm; OPT's LayerNorm)"),
    ("rotary", "rotary embedding"),
    ("other_layer", "other per-layer ops (activation, residuals, embedding, glue)"),
    ("lm_head", "LM head"),
    ("sampling", "sampling"),
    ("runner", "runner (inputs, metadata, histories)"),
)


class RegionTimer:
    """Nanoseconds per category, from wrappers on methods of live objects."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.clock = clock  # perf_counter_ns (wall) or process_time_ns (CPU of every thread)
        self.ns: dict[str, int] = defaultdict(int)
        self._undo: list[tuple[Any, str, Any]] = []

    def timed(self, original: Callable, category: str) -> Callable:
        """``original``, its time added to ``category`` at each call."""
        clock, timer = self.clock, self

        def timed(*args, **kwargs):
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                timer.ns[category] += clock() - start

        return timed

    def wrap(self, obj: Any, name: str, category: str) -> None:
        """Time every call of ``obj.name`` into ``category`` (an instance attribute shadows it)."""
        original = getattr(obj, name)
        self._undo.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, self.timed(original, category))

    def wrap_made(self, obj: Any, name: str, methods: tuple[str, ...], category: str) -> None:
        """Time, into ``category``, the ``methods`` of every object that ``obj.name(...)`` makes (a
        view for one call, which goes when the call's caller lets it go: nothing to undo on it)."""
        original, timer = getattr(obj, name), self

        def made(*args, **kwargs):
            view = original(*args, **kwargs)
            if view is not obj:
                for method in methods:
                    if hasattr(view, method):
                        setattr(view, method, timer.timed(getattr(view, method), category))
            return view

        self._undo.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, made)

    def uninstall(self) -> None:
        """Put every wrapped method back as it was."""
        for obj, name, previous in reversed(self._undo):
            if previous is None:
                delattr(obj, name)
            else:
                setattr(obj, name, previous)
        self._undo = []

    def take(self) -> dict[str, int]:
        """The sums so far, and start again from zero."""
        out, self.ns = dict(self.ns), defaultdict(int)
        return out


def install(runner, timer: RegionTimer) -> Callable[[], None]:
    """Wrap ``runner``'s model, backend and sampler; returns the function that removes it all."""
    from services.executor.linear import PackedLinear, PairLinear  # torch after the thread settings
    from services.executor.layers import MLP, RMSNorm

    model = runner.model
    for module in model.modules():
        if module is model.lm_head:  # timed as compute_logits, outside the forward pass
            continue
        if isinstance(module, (nn.Linear, PackedLinear, PairLinear)):
            timer.wrap(module, "forward", "matmul")
        if isinstance(module, MLP):  # float32 on nn.Linear: gate and up as two F.linear calls
            timer.wrap(module, "separate_gate_up", "matmul")
        if isinstance(module, (RMSNorm, nn.LayerNorm)):  # (OPT's LayerNorms)
            timer.wrap(module, "forward", "norm")
    if hasattr(model, "rotary"):  # Llama's (OPT has learned positions, in "other")
        timer.wrap(model.rotary, "forward", "rotary")
    # a backend with a view per forward pass (the numba backend's ``for_pass``): its fused decode is
    # the view's, whose calls that the view does not take itself reach the backend's (counted once)
    view_methods = ("decode_qkv",) if hasattr(runner.backend, "for_pass") else ()
    for name in ("write_kv", "decode", "prefill", "decode_qkv"):
        if hasattr(runner.backend, name) and name not in view_methods:
            timer.wrap(runner.backend, name, "attention")
    if view_methods:
        timer.wrap_made(runner.backend, "for_pass", view_methods, "attention")
    timer.wrap(model, "forward", "forward")
    timer.wrap(model, "compute_logits", "lm_head")
    timer.wrap(runner.sampler, "sample", "sampling")
    timer.wrap(runner, "execute", "execute")
    return timer.uninstall


def breakdown(ns: dict[str, int]) -> dict[str, int]:
    """The ``EXECUTOR_PARTS`` of one step's raw sums: what is left of the forward pass after its
    timed parts is ``other_layer``, what is left of ``execute`` after the forward pass, the LM
    head and sampling is ``runner``."""
    get = lambda key: ns.get(key, 0)  # noqa: E731
    parts = {key: get(key) for key in ("matmul", "attention", "norm", "rotary", "lm_head", "sampling")}
    parts["other_layer"] = get("forward") - sum(get(k) for k in ("matmul", "attention", "norm", "rotary"))
    parts["runner"] = get("execute") - get("forward") - get("lm_head") - get("sampling")
    return parts
