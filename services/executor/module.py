"""``Module`` and ``Linear``: the model's ``nn.Module`` and ``nn.Linear``, whose call is their
``forward`` where no hook is registered on them.

torch's ``Module.__call__`` looks up the module's forward and backward hooks and the global ones,
and the tracing state, at every call. A decode step of SmolLM2 makes about 300 module calls, each
between matmuls and attention kernels that stream megabytes through the caches, so those lookups
miss in cache. Calling ``forward`` directly is the same computation where there are no hooks, and
the engine registers none. Measured (SmolLM2 in bfloat16, decode batch 1 at context 256, a 2-core
AMD EPYC Zen 4, 60 rounds of the variants in shuffled order, median of the per-round ratios): a
step took 0.980 of its time with torch's call, 0.960 together with the numba backend's per-pass
view (``kernels/cpu/pass_view.py``); docs/journal/profile-journal.md (2026-12-04, nineteenth session)
has the other batches.

A module with a forward or forward-pre hook of its own is called through torch's ``__call__``, so
its hooks run; hooks registered globally (``torch.nn.modules.module.register_module_forward_hook``)
do not run for these modules.
"""

from __future__ import annotations

from torch import nn


class Module(nn.Module):
    """An ``nn.Module`` whose call is ``forward`` unless it has forward hooks of its own."""

    def __call__(self, *args, **kwargs):
        if self._forward_hooks or self._forward_pre_hooks:
            return super().__call__(*args, **kwargs)
        return self.forward(*args, **kwargs)


class Linear(Module, nn.Linear):
    """``nn.Linear``, called as ``Module`` is."""
