"""Helpers shared by the async-scheduling tests (``test_async_scheduling``,
``test_async_equivalence``): adding a request to a bare ``Scheduler``, and ``HashModel``, a fake
executor whose next token hashes the sequence's history (``next_token``)."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from services.executor.histories import TokenHistories
from services.executor.parallel.base import SingleRank
from services.executor.placeholders import SampledTokens
from services.scheduler.scheduler import Scheduler
from shared.messages import PLACEHOLDER_TOKEN_ID as PH
from shared.messages import AddRequest, SamplingParams, Step, StepResult, decode, encode

CPU = torch.device("cpu")
VOCAB = 50


def add_request(sched: Scheduler, rid: str, prompt: list[int], eos=(), **sampling) -> None:
    params = SamplingParams(**{"eos_token_ids": list(eos), **sampling})
    sched.add_request(AddRequest(rid, np.array(prompt, np.int32), params, 0.0))


class HashModel:
    """A fake executor: a sequence's next token hashes its whole history (and its seed), which it
    keeps as the real runner does (``TokenHistories``, placeholders filled by ``SampledTokens``)."""

    def __init__(self) -> None:
        self.histories, self.sampled, self.seeds = TokenHistories(), SampledTokens(), {}
        self.num_placeholders = 0

    def execute(self, step: Step) -> StepResult:
        step = decode(encode(step))
        for seq_id in step.finished_seq_ids:
            self.histories.remove(seq_id)
            self.sampled.remove(seq_id)
        for new in step.new_seqs:
            self.histories.add(new)
            self.seeds[new.seq_id] = new.sampling.seed or 0
        self.num_placeholders += int((step.input_token_ids == PH).sum())
        self.sampled.fill(step, SingleRank(), CPU)
        self.histories.observe(step)
        seq_ids = step.seq_ids[step.sample_mask]
        tokens = np.array([next_token(self.histories.token_ids(s), self.seeds[s]) for s in seq_ids.tolist()], np.int64)
        self.sampled.record(step, seq_ids, tokens)
        return StepResult(step.step_id, seq_ids, tokens)


def next_token(history: list[int], seed: int) -> int:
    digest = hashlib.blake2b(np.array([seed, *history], np.int64).tobytes(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % VOCAB
