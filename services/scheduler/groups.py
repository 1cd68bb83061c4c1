"""Sequence groups beyond plain ``n``: ``best_of`` and in-engine beam search. Mixed into Scheduler.

- ``best_of``: ``best_of`` samples fork from one prefill like ``n`` does; their deltas are held
  back, and when all have finished the ``n`` with the highest cumulative log-probability are sent,
  renumbered ``0 .. n-1``.
- Beam search (width ``n``): every live beam of a request is one sequence. After each step the
  executor returns each beam's top ``2n`` next tokens; ``BeamSearch`` picks the continuations, and
  the group is reshaped over shared blocks: a beam with one continuation appends its token, one with
  several forks (the children share all its blocks, the partial one copied on first write), one
  with none is freed. When the search is done, the ``n`` best hypotheses are sent.
"""

from __future__ import annotations

import dataclasses

from shared.messages import RequestOutput, SamplingParams, StepResult

from .beam_search import Beam, BeamSearch
from .sequence import Sequence, SequenceStatus


class SequenceGroupsMixin:
    def _init_groups(self) -> None:
        self.beam_searches: dict[str, BeamSearch] = {}
        # request -> (n, all samples, the logprobs the user asked for)
        self.best_of: dict[str, tuple[int, list[Sequence], int | None]] = {}
        self.held: dict[int, list[RequestOutput]] = {}  # seq_id -> deltas held back (best_of)

    # ------------------------------------------------------------------ set-up

    def _group_sampling(self, request_id: str, sampling: SamplingParams, num_prompt_tokens: int,
                        eos_token_ids: list[int]) -> tuple[SamplingParams, int]:
        """The sampling the executors get, and how many sequences to start."""
        if sampling.use_beam_search:
            width = sampling.n
            max_tokens = min(sampling.max_tokens, self.config.max_model_len - num_prompt_tokens)
            self.beam_searches[request_id] = BeamSearch(
                width, max_tokens, frozenset(eos_token_ids), sampling.ignore_eos, sampling.length_penalty,
                sampling.early_stopping,
            )
            return dataclasses.replace(sampling, n=1, temperature=0.0, logprobs=2 * width, best_of=None), 1
        if sampling.best_of is not None and sampling.best_of > sampling.n:
            # The executor must report each sampled token's logprob for the ranking.
            logprobs = 0 if sampling.logprobs is None else sampling.logprobs
            return dataclasses.replace(sampling, logprobs=logprobs), sampling.best_of
        return sampling, sampling.n

    def _start_groups(self, request_id: str, seqs: list[Sequence], sampling: SamplingParams) -> None:
        if request_id in self.beam_searches:
            return
        if sampling.best_of is not None and sampling.best_of > sampling.n:
            self.best_of[request_id] = (sampling.n, seqs, sampling.logprobs)

    def _forget_groups(self, request_id: str) -> None:
        self.beam_searches.pop(request_id, None)
        _, seqs, _ = self.best_of.pop(request_id, (0, [], None))
        for seq in seqs:
            self.held.pop(seq.seq_id, None)

    # ------------------------------------------------------------------ per step

    def _take_group_token(self, seq: Sequence, result: StepResult, row: int) -> bool:
        """Handle a sampled row for a beam (store its candidates); True if it was one."""
        search = self.beam_searches.get(seq.request_id)
        if search is None:
            return False
        k = search.num_candidates
        seq.beam_candidates = (result.top_token_ids[row, :k].tolist(), result.top_logprobs[row, :k].tolist())
        return True

    def _route_delta(self, seq: Sequence, delta: RequestOutput) -> list[RequestOutput]:
        """Send a delta now, or hold it back while its best_of group is still running."""
        group = self.best_of.get(seq.request_id)
        if group is None:
            return [delta]
        self.held.setdefault(seq.seq_id, []).append(delta)
        n, seqs, user_logprobs = group
        if not all(s.status is SequenceStatus.FINISHED for s in seqs):
            return []
        del self.best_of[seq.request_id]
        best = sorted(seqs, key=lambda s: -s.cum_logprob)[:n]
        merged = [_merge(self.held.pop(s.seq_id, []), i, user_logprobs is not None) for i, s in enumerate(best)]
        for s in seqs:
            self.held.pop(s.seq_id, None)
        return merged

    def _advance_beams(self, request_id: str) -> list[RequestOutput]:
        """Run one beam-search decision once every live beam of the request has its candidates."""
        search = self.beam_searches.get(request_id)
        live = [s for s in self.requests.get(request_id, []) if s.status is not SequenceStatus.FINISHED]
        if search is None or not live or any(s.beam_candidates is None for s in live):
            return []
        beams = [Beam(s.seq_id, s.output_token_ids, s.cum_logprob, *s.beam_candidates) for s in live]
        for s in live:
            s.beam_candidates = None
        continuations = search.step(beams)
        if search.done:
            return self._finish_beams(request_id, live, search)
        children: dict[int, list] = {}
        for c in continuations:
            children.setdefault(c.parent_key, []).append(c)
        survivors = []
        for seq in live:
            mine = children.get(seq.seq_id, [])
            if not mine:
                self._drop_beam(seq)
                continue
            for c in mine[1:]:  # fork before the parent appends its own token
                child = self._fork_sequence(seq)
                child.append_token(c.token_id)
                child.cum_logprob = c.cum_logprob
                survivors.append(child)
            seq.append_token(mine[0].token_id)
            seq.cum_logprob = mine[0].cum_logprob
            survivors.append(seq)
        self.requests[request_id] = survivors
        return []

    def _finish_beams(self, request_id: str, live: list[Sequence], search: BeamSearch) -> list[RequestOutput]:
        for seq in live:
            self._drop_beam(seq)
        prompt = live[0]
        self.requests.pop(request_id, None)
        del self.beam_searches[request_id]
        return [
            RequestOutput(request_id, i, list(h.token_ids), "stop" if h.ended_with_eos else "length",
                          num_prompt_tokens=prompt.num_prompt_tokens, num_cached_tokens=prompt.num_cached_tokens,
                          num_preemptions=max(s.num_preemptions for s in live))
            for i, h in enumerate(search.results(len(search.finished)))
        ]

    def _drop_beam(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped = type(self.swapped)(
                [s for s in g if s is not seq] for g in self.swapped if any(s is not seq for s in g))
            self.blocks.free_swapped(seq.seq_id)
        self._release(seq, "pruned")

    def _fork_sequence(self, parent: Sequence) -> Sequence:
        """A running copy of ``parent`` sharing all its blocks."""
        child = dataclasses.replace(
            parent, seq_id=self._next_seq_id, output_token_ids=list(parent.output_token_ids),
            block_hashes=list(parent.block_hashes), pending_children=[], announced=False,
            beam_candidates=None, num_output_sent=len(parent.output_token_ids),
        )
        self._next_seq_id += 1
        self.blocks.fork(parent.seq_id, child.seq_id)
        self._insert_running(child)
        return child


def _merge(deltas: list[RequestOutput], choice_idx: int, keep_logprobs: bool) -> RequestOutput:
    """One delta holding everything a held-back sequence produced."""
    last = deltas[-1]
    merged = dataclasses.replace(last, choice_idx=choice_idx, new_token_ids=[], logprobs=[], top_token_ids=[],
                                 top_logprobs=[])
    for d in deltas:
        merged.new_token_ids += d.new_token_ids
        if not keep_logprobs:
            continue
        merged.logprobs += d.logprobs
        merged.top_token_ids += d.top_token_ids
        merged.top_logprobs += d.top_logprobs
    return merged
