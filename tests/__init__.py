"""pagedserve's tests. Importing this package turns transformers' hub kernels off before any test
code imports transformers (``shared/hub_kernels.py``: the name ``kernels`` is ours here), in the
test run's processes and in any process it spawns that unpickles test code (rank groups started
with ``spawn`` import ``tests.doubles`` before they rebuild a model)."""

from shared.hub_kernels import hide_hub_kernels

hide_hub_kernels()
