"""Placeholders in a step's input tokens (async scheduling): each becomes the token its sequence
sampled in the step before.

The scheduler plans step N + 1 while the executors run step N, so a sequence sampled in N is fed,
in N + 1, ``PLACEHOLDER_TOKEN_ID`` at the position of that sample. Rank 0 keeps the token it
sampled last for each sequence and its position (``record``); ``fill`` puts it in the place of
every placeholder of the next step, before the token histories see the step, so that penalties and
``min_tokens`` count the real token as they do in lock-step. A placeholder at a position other than
the recorded one means the scheduler and the executor disagree: the step fails.

Tensor parallelism: only rank 0 samples, so the ranks agree on the tokens through one all-reduce of
the placeholders' ids (rank 0's, zeros elsewhere) in float32, exact for ids below
``MAX_SHARED_TOKEN_ID``; every rank sees the same step, so all of them call it or none does.

A step that failed on a single rank (the scheduler fails its requests when the error comes back)
samples nothing; the next step, planned before the failure was known, may still feed its sequences
placeholders: they get token 0, and what it computes for them is dropped with their requests.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.messages import PLACEHOLDER_TOKEN_ID, Step

MAX_SHARED_TOKEN_ID = 2**24  # float32 holds every integer below it exactly


class SampledTokens:
    """``seq_id`` -> (position, token id) of the last token rank 0 sampled for it."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int]] = {}
        self._failed: set[int] = set()  # sequences of a failed step: their placeholders get token 0

    def record(self, step: Step, seq_ids: np.ndarray, token_ids: np.ndarray) -> None:
        """``seq_ids`` (``step``'s sampled sequences, in order) sampled ``token_ids``."""
        positions = step.context_lens[step.sample_mask]  # a sample's position: its context length
        for seq_id, position, token_id in zip(seq_ids.tolist(), positions.tolist(), token_ids.tolist()):
            self._last[seq_id] = (position, token_id)

    def forget_failed(self, step: Step) -> None:
        """``step`` failed: its sequences sampled nothing."""
        for seq_id in step.seq_ids.tolist():
            self._last.pop(seq_id, None)
            self._failed.add(seq_id)

    def remove(self, seq_id: int) -> None:
        self._last.pop(seq_id, None)
        self._failed.discard(seq_id)

    def clear(self) -> None:
        self._last.clear()
        self._failed.clear()

    def fill(self, step: Step, comm, device: torch.device) -> None:
        """Replace ``step``'s placeholders in ``step.input_token_ids`` (in place) with the tokens
        rank 0 sampled. Raises ``ValueError`` on a placeholder rank 0 has no token for."""
        idx = np.flatnonzero(step.input_token_ids == PLACEHOLDER_TOKEN_ID)
        if not len(idx):
            return
        token_ids = self._tokens_at(step, idx) if comm.rank == 0 else np.zeros(len(idx), np.int64)
        if comm.world_size > 1:
            with torch.inference_mode():  # as the forward pass: the group's buffers are inference tensors
                shared = torch.from_numpy(token_ids.astype(np.float32)).to(device)  # [P]
                token_ids = np.rint(comm.all_reduce_(shared).cpu().numpy()).astype(np.int64)
        step.input_token_ids[idx] = token_ids

    def _tokens_at(self, step: Step, idx: np.ndarray) -> np.ndarray:
        """[P] int64: the token for each placeholder at flat indices ``idx`` of the step's tokens."""
        rows = np.searchsorted(step.query_start_loc, idx, side="right") - 1  # the sequence of each
        token_ids = np.zeros(len(idx), np.int64)
        for i, (seq_id, position) in enumerate(zip(step.seq_ids[rows].tolist(), step.positions[idx].tolist())):
            last = self._last.get(seq_id)
            if last is None and seq_id in self._failed:
                continue  # token 0: its request failed with the step before
            if last is None or last[0] != position:
                known = "no sample" if last is None else f"a sample at position {last[0]}"
                raise ValueError(f"step {step.step_id} feeds sequence {seq_id} a placeholder at position "
                                 f"{position}, but the executor has {known} for it")
            if last[1] >= MAX_SHARED_TOKEN_ID:
                raise ValueError(f"token id {last[1]} is too large to share between ranks (at most "
                                 f"{MAX_SHARED_TOKEN_ID - 1})")
            token_ids[i] = last[1]
        return token_ids
