"""Turn logits into tokens: logit bias, min-tokens bans, penalties, greedy or random sampling with
temperature, min-p, top-k and top-p, per-request seeds, and logprobs.

A request with a ``seed`` gets its own ``torch.Generator``, so its samples do not depend on what
else is in the batch; requests without one share the sampler's generator.

Penalties and ``min_tokens`` read each sequence's tokens from the executor's ``TokenHistories``
(prompt and outputs apart): repetition counts both, presence and frequency the outputs only, and
``min_tokens`` compares with the number of outputs so far.

Greedy rows take the first largest logit (``torch.argmax``; on CPU its vectorized Numba form,
``kernels/cpu/argmax.py``: the same index in a sixth of the time at 64 rows). Random rows are
drawn by inverse CDF (``draw.py``), one uniform number per row; top-k and top-p look at each
row's most likely tokens first and sort a whole row only when its nucleus is larger
(``logits_processors.truncate``).

Logprobs are those of the model's raw distribution (log-softmax of the logits before logit bias,
bans, penalties and temperature), as vLLM reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.cpu.argmax import argmax_
from shared.messages import SamplingParams

from . import logits_processors as lp
from .draw import draw
from .guided import GuidedSequences, GuideUnavailable
from .histories import TokenHistories


@dataclass
class _SeqState:
    seq_id: int
    params: SamplingParams
    has_penalty: bool
    generator: torch.Generator | None = None  # only with a seed; made on the logits' device


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [N] int64
    # Empty unless a sequence asked for logprobs; then as in ``StepResult``.
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # [N]
    top_token_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))  # [N, K]
    top_logprobs: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # [N, K]
    # Guided sequences this executor could not guide (``GuideUnavailable``): seq id -> why. Their
    # tokens are not theirs to keep; the scheduler fails those requests, alone.
    failed: dict[int, str] = field(default_factory=dict)


def _has_penalty(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


class Sampler:
    """``histories``: the executor's token histories, which the sampler only reads (default: its
    own, empty ones: every sequence then has no tokens and no outputs)."""

    def __init__(self, seed: int = 0, histories: TokenHistories | None = None) -> None:
        self._seqs: dict[int, _SeqState] = {}
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self.histories = histories if histories is not None else TokenHistories()
        # Structured output: the executor sets ``guided.load_vocabulary`` (its tokenizer, for llguidance).
        self.guided = GuidedSequences(self.histories)

    def add(self, seq_id: int, params: SamplingParams) -> None:
        self._seqs[seq_id] = _SeqState(seq_id, params, has_penalty=_has_penalty(params))
        if params.guided:
            self.guided.add(seq_id, params.guided)

    def remove(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self.guided.remove(seq_id)

    def clear(self) -> None:
        self._seqs.clear()
        self.guided.clear()

    def __len__(self) -> int:
        return len(self._seqs)

    def sample(self, logits: torch.Tensor, seq_ids: list[int]) -> SampleOutput:
        """logits: [N, vocab] for the sequences ``seq_ids`` (float32, or the model's 16-bit dtype:
        widened to float32, exactly, wherever they are computed with); one token each, and logprobs."""
        states = [self._seqs[s] for s in seq_ids]
        raw = logits
        logits = self._process(logits, states)
        failed: dict[int, str] = {}
        if any(s.params.guided for s in states):
            logits = self._guide(raw, logits, states, failed)
        tokens = argmax_(logits)  # greedy rows are done (torch.argmax, or its Numba form on CPU)
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if random_rows:
            picked = self._sample_random(logits[random_rows].float(), [states[i] for i in random_rows])
            tokens[random_rows] = picked
        out = self._logprobs(raw, tokens, states)
        out.failed = failed
        return out

    def processed(self, logits: torch.Tensor, seq_ids: list[int]) -> tuple[torch.Tensor, list[SamplingParams]]:
        """``logits`` (one row per id of ``seq_ids``) with logit bias, bans and penalties applied as
        ``sample`` applies them (not guided masks), and each row's parameters: what speculative
        decoding verifies against (``speculative``)."""
        states = [self._seqs[s] for s in seq_ids]
        return self._process(logits, states), [s.params for s in states]

    def generator_for(self, seq_id: int, device: torch.device) -> torch.Generator:
        """The generator ``seq_id``'s random draws come from (its own with a seed, else the shared one)."""
        return self._generator(self._seqs[seq_id], device)

    # ------------------------------------------------------------------ steps of ``sample``

    def _process(self, logits: torch.Tensor, states: list[_SeqState]) -> torch.Tensor:
        """Logit bias, then bans, then penalties, on a float32 copy; returns ``logits`` itself when
        nothing applies."""
        bias_rows, bias_ids, bias_values = [], [], []
        ban_rows, ban_ids = [], []
        for row, state in enumerate(states):
            params = state.params
            bias_rows += [row] * len(params.logit_bias_token_ids)
            bias_ids += params.logit_bias_token_ids
            bias_values += params.logit_bias_values
            banned = self._banned_token_ids(state)
            ban_rows += [row] * len(banned)
            ban_ids += banned
        penalty_rows = [i for i, s in enumerate(states) if s.has_penalty]
        if not (bias_rows or ban_rows or penalty_rows):
            return logits
        logits = logits.to(torch.float32, copy=True)
        lp.add_logit_bias(logits, bias_rows, bias_ids, bias_values)
        lp.ban_tokens(logits, ban_rows, ban_ids)
        if penalty_rows:
            group = [states[i] for i in penalty_rows]
            tokens = [np.asarray(self.histories.token_ids(s.seq_id), np.int64) for s in group]
            splits = [self.histories.num_prompt_tokens(s.seq_id) for s in group]
            logits[penalty_rows] = lp.apply_penalties(
                logits[penalty_rows],
                prompt_tokens=[t[:n] for t, n in zip(tokens, splits)],
                output_tokens=[t[n:] for t, n in zip(tokens, splits)],
                repetition=[s.params.repetition_penalty for s in group],
                presence=[s.params.presence_penalty for s in group],
                frequency=[s.params.frequency_penalty for s in group],
            )
        return logits

    def _guide(self, raw: torch.Tensor, logits: torch.Tensor, states: list[_SeqState],
               failed: dict[int, str]) -> torch.Tensor:
        """Guided rows keep only the tokens their guide allows (``guided.py``), after every other
        edit. A row whose allowed tokens are all banned (its guide's end is an EOS that
        ``min_tokens`` bans) takes them from its raw logits: the guide wins. A row that cannot be
        guided goes into ``failed``."""
        out = logits.to(torch.float32, copy=True) if logits is raw else logits
        vocab, device = out.shape[1], out.device
        rows = [row for row, state in enumerate(states) if state.params.guided]
        masks = self.guided.masks([(states[row].seq_id, states[row].params.eos_token_ids) for row in rows])
        for row, tokens in zip(rows, masks):
            state = states[row]
            if isinstance(tokens, GuideUnavailable):
                failed[state.seq_id] = str(tokens)
                continue
            ids = torch.from_numpy(tokens.ids[tokens.ids < vocab]).to(device)
            target = out[row]
            if tokens.keep and not len(ids):  # a finished guide with no EOS id to end on: left free
                continue
            if tokens.keep:
                banned = self._banned_token_ids(state)
                source = raw[row].float() if banned and tokens.only_among(banned) else target
                kept = source.index_select(0, ids)
                target.fill_(lp.NEG_INF)
                target.index_copy_(0, ids, kept)
            else:
                target.index_fill_(0, ids, lp.NEG_INF)
        return out

    def _banned_token_ids(self, state: _SeqState) -> list[int]:
        """Tokens that would end the sequence, banned until ``min_tokens`` outputs exist."""
        params = state.params
        if not params.min_tokens or self.histories.num_output_tokens(state.seq_id) >= params.min_tokens:
            return []
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            ids += params.eos_token_ids
        return ids

    def _sample_random(self, logits: torch.Tensor, states: list[_SeqState]) -> torch.Tensor:
        """logits: [R, vocab] of the non-greedy rows; returns [R] int64 sampled token ids."""
        params = [s.params for s in states]
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        logits = lp.truncate(
            logits / temps.unsqueeze(1),
            min_p=[p.min_p for p in params],
            top_k=[p.top_k or 0 for p in params],
            top_p=[p.top_p for p in params],
        )
        picked = draw(logits.softmax(-1), self._uniforms(states, logits.device))
        # A row whose distribution is not finite (it should not happen) takes its argmax rather than
        # failing the whole step.
        if bool((picked < 0).any()):
            picked = torch.where(picked >= 0, picked, torch.argmax(logits, dim=-1))
        return picked

    def _uniforms(self, states: list[_SeqState], device: torch.device) -> torch.Tensor:
        """[R] float32 uniforms in [0, 1): seeded rows from their own generators, the others from
        the shared one, in row order."""
        out = torch.empty(len(states), device=device)
        shared = [i for i, s in enumerate(states) if s.params.seed is None]
        if shared:
            out[shared] = torch.rand(len(shared), device=device, generator=self._generator(states[shared[0]], device))
        for i, state in enumerate(states):
            if state.params.seed is not None:
                out[i] = torch.rand(1, device=device, generator=self._generator(state, device))[0]
        return out

    def _generator(self, state: _SeqState, device: torch.device) -> torch.Generator:
        if state.params.seed is None:
            if device not in self._shared:
                self._shared[device] = torch.Generator(device=device).manual_seed(self._seed)
            return self._shared[device]
        if state.generator is None:
            # Any 64-bit seed the API accepts, folded into what manual_seed takes.
            state.generator = torch.Generator(device=device).manual_seed(state.params.seed % 2**64)
            # A sequence announced with outputs (migrated to this replica, or handed to new executors after a
            # crash) continues its stream: one draw per output sampled before.
            for _ in range(self.histories.num_output_tokens(state.seq_id)):
                torch.rand(1, device=device, generator=state.generator)
        return state.generator

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, states: list[_SeqState]) -> SampleOutput:
        wanted = [s.params.logprobs for s in states if s.params.logprobs is not None]
        if not wanted:
            return SampleOutput(tokens)
        logprobs = torch.log_softmax(raw.float(), dim=-1)  # [N, vocab]
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        num_top = min(max(wanted), logprobs.shape[1])
        top = torch.topk(logprobs, num_top, dim=-1)
        return SampleOutput(
            tokens,
            chosen.cpu().numpy().astype(np.float32),
            top.indices.cpu().numpy().astype(np.int64),
            top.values.cpu().numpy().astype(np.float32),
        )
