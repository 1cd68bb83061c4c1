"""Prompt lookup (the ``ngram`` proposer): guess a sequence's next tokens from its own history.

The last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked
for earlier in the prompt and the output; at the most recent earlier place where they occur and
are followed by ``k`` tokens (else the earliest, followed by the most), the tokens that followed
there (at most ``k``) are the proposal. The longest suffix that occurs wins;
none occurring proposes nothing. Plain numpy, no I/O: one vectorized comparison per ``n``.

It runs in the scheduler, where every sequence's whole token history already lives (the
executors hold one too, but only rank 0 samples, and the scheduler decides how many slots each
sequence gets in the step: proposing where the slots are allocated keeps it one decision).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids, k: int) -> list[int]:
        """At most ``k`` tokens that followed the longest, most recent earlier match of the history's
        suffix; [] when no suffix of ``min_n`` or more tokens occurred before (or ``k`` is 0)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0 .. length - n - 1: each is followed by at least one token
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(hits):
                whole = hits[hits + n + k <= length]  # matches followed by k tokens
                start = int(whole[-1] if len(whole) else hits[0]) + n
                return tokens[start:start + k].tolist()
        return []
