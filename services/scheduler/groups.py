"""Sequence groups: how the sequences of one request turn into that request's outputs.

The scheduler owns where sequences are (its queues, the block manager); a group owns what they
are and what they say. ``new_group`` picks the group for a request's sampling:

- ``SequenceGroup`` (plain ``n``): ``n`` samples, forked from one prefill by the scheduler; each
  sends its deltas as they come.
- ``BestOfGroup``: ``best_of`` samples the same way; their deltas are held back, and when all have
  finished the ``n`` with the highest cumulative log-probability are sent, renumbered ``0 .. n-1``.
- ``BeamGroup`` (beam search of width ``n``): every live beam is one sequence. The executor returns
  each beam's top ``2n`` next tokens; once every live beam has its candidates, ``BeamSearch`` picks
  the continuations: a beam with one continuation appends its token, one with several also forks
  children (sharing all its blocks), one with none is pruned. When the search is done the best
  hypotheses, ``n`` at most, are sent.

A group answers each event (a sampled row, a prompt computed with nothing to sample, a sequence
that outgrew the KV pool, a failure, an abort) with a ``GroupUpdate`` that the scheduler applies:
forks to start, finished sequences (their ``finish_reason`` set) to take out of its queues and
free, outputs to send. The last output of a request carries ``request_finished``; the group is
then ``done``. A request with ``prompt_logprobs`` has its prompt scored by its first sequence
(``PromptScores``), and its first output carries the scores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

from shared.messages import AddRequest, RequestOutput, SamplingParams

from .beam_search import Beam, BeamSearch
from .outputs import Sample, delta, error_output, merged
from .pooling import Pooling
from .prompt_scores import PromptScores
from .sequence import ErrorKind, FinishReason, Sequence


@dataclass
class Fork:
    """Start ``child``, a new sequence sharing every block of ``parent``."""

    parent: Sequence
    child: Sequence


@dataclass
class GroupUpdate:
    """A group's decision, applied by the scheduler in this order: forks, finished, outputs."""

    forks: list[Fork] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)


def num_sequences(sampling: SamplingParams) -> int:
    """How many sequences a request runs at once at first (beam search starts from one)."""
    if sampling.use_beam_search:
        return sampling.n
    return max(sampling.n, sampling.best_of or 0)


def new_group(request: AddRequest, max_model_len: int, seq_ids: Iterator[int]) -> "SequenceGroup":
    """The group for ``request``; its sequences take their ids from ``seq_ids``."""
    sampling = request.sampling
    if sampling.use_beam_search:
        return BeamGroup(request, max_model_len, seq_ids)
    if sampling.best_of is not None and sampling.best_of > sampling.n:
        return BestOfGroup(request, max_model_len, seq_ids)
    return SequenceGroup(request, max_model_len, seq_ids)


class SequenceGroup:
    """Plain ``n``: every sequence is a choice of its own, its deltas sent as they come.

    ``seqs``: the sequences the group tracks, the first to prefill first; the scheduler forks the
    others from it once the prompt is in the cache."""

    def __init__(self, request: AddRequest, max_model_len: int, seq_ids: Iterator[int]) -> None:
        self.request_id = request.request_id
        self.max_model_len = max_model_len
        self._seq_ids = seq_ids
        prompt = [int(t) for t in request.prompt_token_ids]
        sampling = self._executor_sampling(request.sampling, len(prompt))
        self.seqs: list[Sequence] = []
        for choice_idx in range(self._num_initial_seqs(request.sampling)):
            seq_sampling = sampling
            if sampling.seed is not None and choice_idx:  # distinct, reproducible streams
                seq_sampling = dataclasses.replace(sampling, seed=(sampling.seed + choice_idx) % 2**63)
            self.seqs.append(Sequence(
                seq_id=next(seq_ids), request_id=request.request_id, choice_idx=choice_idx,
                prompt_token_ids=prompt, sampling=seq_sampling,
                eos_token_ids=frozenset(sampling.eos_token_ids), arrival_time=request.arrival_time,
            ))
        resumed = [int(t) for t in request.resumed_token_ids]  # sent before a scheduler restart
        self.seqs[0].output_token_ids, self.seqs[0].num_output_sent = resumed, len(resumed)
        self.prompt_scores: PromptScores | None = None
        if request.sampling.prompt_logprobs is not None:
            self.prompt_scores = PromptScores(len(prompt), request.sampling.prompt_logprobs)
            self.seqs[0].prompt_scores = self.prompt_scores
        self.pooling: Pooling | None = None
        if request.sampling.pooling is not None:
            self.pooling = self.seqs[0].pooling = Pooling(len(prompt), request.sampling.pooling)

    def _executor_sampling(self, sampling: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """The sampling the executors get for every sequence of the group."""
        return sampling

    def _num_initial_seqs(self, sampling: SamplingParams) -> int:
        return num_sequences(sampling)

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if s.finish_reason is None]

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    # ------------------------------------------------------------------ events

    def on_sample(self, seq: Sequence, sample: Sample) -> GroupUpdate:
        """``seq`` sampled a token: append it, end the sequence if it stops, send the delta."""
        seq.append_token(sample.token_id)
        if sample.logprob is not None:
            seq.cum_logprob += sample.logprob
        update = GroupUpdate()
        reason = seq.stop_reason(self.max_model_len)
        if reason is not None:
            self._end([seq], reason, update)
        self._send([delta(seq, sample)], update)
        return self._closed(update)

    def on_prompt_done(self, seq: Sequence) -> GroupUpdate:
        """``seq`` computed its prompt and ``max_tokens`` is 0: it ends with ``length`` and no
        token, and so do the samples that were to fork from it."""
        return self._end_with_pending(seq)

    def on_outgrown(self, seq: Sequence) -> GroupUpdate:
        """``seq`` (preempted, or reserving for the contiguous policy) no longer fits in the pool:
        it ends with ``length``, and so do the samples that were to fork from it."""
        return self._end_with_pending(seq)

    def _end_with_pending(self, seq: Sequence) -> GroupUpdate:
        update = GroupUpdate()
        ended = [seq, *seq.pending_children]
        seq.pending_children = []
        self._end(ended, FinishReason.LENGTH, update)
        self._send([delta(s) for s in ended], update)
        return self._closed(update)

    def fail(self, message: str, kind: ErrorKind = ErrorKind.REQUEST) -> GroupUpdate:
        """End every live sequence; the request's only remaining output is the error."""
        update = GroupUpdate()
        self._end(self.live, FinishReason.ERROR, update)
        update.outputs.append(error_output(self.request_id, message, kind))
        return update

    def abort(self) -> GroupUpdate:
        """End every live sequence, sending nothing (the frontend asked)."""
        update = GroupUpdate()
        self._end(self.live, FinishReason.ABORT, update)
        return update

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _end(seqs: list[Sequence], reason: FinishReason, update: GroupUpdate) -> None:
        for seq in seqs:
            seq.finish_reason = reason
            update.finished.append(seq)

    def _send(self, outputs: list[RequestOutput], update: GroupUpdate) -> None:
        update.outputs += outputs

    def _closed(self, update: GroupUpdate) -> GroupUpdate:
        """The first output carries the prompt's scores (once), the last ``request_finished``."""
        if update.outputs and self.prompt_scores is not None:
            self.prompt_scores.attach(update.outputs[0])
        if update.outputs and self.pooling is not None:
            self.pooling.attach(update.outputs[-1])
        if update.outputs and self.done:
            update.outputs[-1].request_finished = True
        return update


class BestOfGroup(SequenceGroup):
    """``best_of`` samples; the ``n`` most likely are sent once all have finished."""

    def __init__(self, request: AddRequest, max_model_len: int, seq_ids: Iterator[int]) -> None:
        self.n = request.sampling.n
        self.user_logprobs = request.sampling.logprobs
        self.held: dict[int, list[RequestOutput]] = {}  # choice_idx -> deltas held back
        super().__init__(request, max_model_len, seq_ids)

    def _executor_sampling(self, sampling: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        # The executor must report each sampled token's logprob for the ranking.
        return dataclasses.replace(sampling, logprobs=0 if sampling.logprobs is None else sampling.logprobs)

    def on_outgrown(self, seq: Sequence) -> GroupUpdate:
        return self.fail("the sequence group outgrew the KV pool")

    def _send(self, outputs: list[RequestOutput], update: GroupUpdate) -> None:
        for out in outputs:
            self.held.setdefault(out.choice_idx, []).append(out)
        if not self.done:
            return
        best = sorted(self.seqs, key=lambda s: -s.cum_logprob)[: self.n]
        keep_logprobs = self.user_logprobs is not None
        update.outputs += [merged(self.held[s.choice_idx], i, keep_logprobs) for i, s in enumerate(best)]
        self.held.clear()


class BeamGroup(SequenceGroup):
    """Beam search of width ``n``, transformers' rules (``BeamSearch``), over shared blocks."""

    def __init__(self, request: AddRequest, max_model_len: int, seq_ids: Iterator[int]) -> None:
        sampling = request.sampling
        max_tokens = min(sampling.max_tokens, max_model_len - len(request.prompt_token_ids))
        self.search = BeamSearch(sampling.n, max_tokens, frozenset(sampling.eos_token_ids), sampling.ignore_eos,
                                 sampling.length_penalty, sampling.early_stopping)
        super().__init__(request, max_model_len, seq_ids)

    def _executor_sampling(self, sampling: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        return dataclasses.replace(sampling, n=1, temperature=0.0, logprobs=self.search.num_candidates,
                                   best_of=None)

    def _num_initial_seqs(self, sampling: SamplingParams) -> int:
        return 1

    def on_sample(self, seq: Sequence, sample: Sample) -> GroupUpdate:
        """Keep ``seq``'s candidates; decide once every live beam has its own."""
        k = self.search.num_candidates
        seq.beam_candidates = (list(sample.top_token_ids[:k]), list(sample.top_logprobs[:k]))
        live = self.live
        if any(s.beam_candidates is None for s in live):
            return GroupUpdate()
        return self._closed(self._decide(live))

    def on_outgrown(self, seq: Sequence) -> GroupUpdate:
        return self.fail("the sequence group outgrew the KV pool")

    def _decide(self, live: list[Sequence]) -> GroupUpdate:
        beams = [Beam(s.seq_id, s.output_token_ids, s.cum_logprob, *s.beam_candidates) for s in live]
        for s in live:
            s.beam_candidates = None
        continuations = self.search.step(beams)
        update = GroupUpdate()
        if self.search.done:
            self._end(live, FinishReason.PRUNED, update)
            self._send(self._hypotheses(live), update)
            return update
        children: dict[int, list] = {}
        for c in continuations:
            children.setdefault(c.parent_key, []).append(c)
        survivors = []
        for seq in live:
            mine = children.get(seq.seq_id, [])
            if not mine:
                self._end([seq], FinishReason.PRUNED, update)
                continue
            for c in mine[1:]:  # a child copies the parent's tokens before the parent appends its own
                child = self._forked(seq, c.token_id, c.cum_logprob)
                update.forks.append(Fork(seq, child))
                survivors.append(child)
            seq.append_token(mine[0].token_id)
            seq.cum_logprob = mine[0].cum_logprob
            survivors.append(seq)
        self.seqs = survivors  # pruned beams leave the group (the update still frees them)
        return update

    def _forked(self, parent: Sequence, token_id: int, cum_logprob: float) -> Sequence:
        """A copy of ``parent`` (placement included: it runs where the parent runs) plus one token."""
        return dataclasses.replace(
            parent, seq_id=next(self._seq_ids), output_token_ids=[*parent.output_token_ids, token_id],
            cum_logprob=cum_logprob, block_hashes=list(parent.block_hashes), pending_children=[],
            announced=False, beam_candidates=None, num_output_sent=len(parent.output_token_ids) + 1,
            prompt_scores=None,
        )

    def _hypotheses(self, live: list[Sequence]) -> list[RequestOutput]:
        """One output per finished hypothesis, best first (``BeamSearch`` always finishes one)."""
        first = live[0]
        return [
            RequestOutput(self.request_id, i, list(h.token_ids),
                          (FinishReason.STOP if h.ended_with_eos else FinishReason.LENGTH).value,
                          num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=first.num_cached_tokens,
                          num_preemptions=max(s.num_preemptions for s in live))
            for i, h in enumerate(self.search.results(len(self.search.finished)))
        ]
