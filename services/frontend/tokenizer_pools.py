"""Tokenizer work off the event loop, where a big input cannot hold up a small one.

Inputs of up to ``LARGE_INPUT_CHARS`` characters run on a pool of ``num_small_workers`` threads,
larger ones on a pool of their own, so a one-line chat never queues behind a long document. The
pools share the served model's one tokenizer: a Hugging Face fast tokenizer encodes and decodes
under a shared borrow of its Rust object and releases the GIL while it works, so threads run in
parallel; only changing its truncation or padding would take an exclusive borrow (``RuntimeError:
Already borrowed``), and nothing in the frontend does.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

LARGE_INPUT_CHARS = 16_384  # about 20 ms of tokenizing on one core


class TokenizerPools:
    """Two thread pools, by input size. ``run`` takes the work's size in characters."""

    def __init__(self, num_small_workers: int = 2, num_large_workers: int = 1) -> None:
        self._small = ThreadPoolExecutor(num_small_workers, thread_name_prefix="tokenizer")
        self._large = ThreadPoolExecutor(num_large_workers, thread_name_prefix="tokenizer-large")

    async def run(self, num_chars: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a tokenizer thread. Cancelling the caller drops the work if it has not started."""
        pool = self._large if num_chars > LARGE_INPUT_CHARS else self._small
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def shutdown(self) -> None:
        for pool in (self._small, self._large):
            pool.shutdown(wait=False, cancel_futures=True)
