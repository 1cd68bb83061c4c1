"""When and how much to speculate (``--speculative-config``): the scheduler's side of speculative
decoding. Plain Python, no I/O but one log line per kind of request that decodes without it.

For a decoding sequence, ``drafts`` returns the tokens to verify in its next step (the proposer's
guess, ``ngram``), or [] to decode one token as usual:
- only requests whose sampling the executor can verify exactly: no logprobs (the rows' logprobs
  would be those of the verification, not worth the wire), no penalties or ``min_tokens`` (they
  change from one position to the next with the tokens proposed), no guided decoding, no beam
  search or ``best_of`` (their cumulative logprobs); those decode without speculation;
- with async scheduling, lock-step while a sequence would propose (``wants_lockstep``);
- never past ``max_tokens`` or the model's length: the accepted tokens plus one always fit;
- adaptive: each sequence's acceptance is tracked (an exponential average of accepted / proposed);
  its proposal length follows it (``k`` times the rate, rounded up), and below ``MIN_RATE`` it stops
  speculating for ``PAUSE_STEPS`` steps, then tries again with one token. With more sequences
  running a draft costs more (below), so the rate needed rises by ``RATE_PER_SEQ`` for each one
  beyond the first (0.62 at 8: on the EPYC, 8 streams broke even at about 0.65);
- under load less, then none: a step's rows (one per running sequence, plus the drafts) stay
  within ``STEP_ROWS``, shared evenly: each running sequence proposes at most
  ``(STEP_ROWS - running) // running`` tokens (k at one stream, 1 at 8, none from 16). On the
  2-core EPYC a step's cost grows with its rows once a few sequences run (the 49k-token logits
  alone are a matmul per row), so verifying 4 drafts for each of 8 sequences was slower than
  plain decoding. None either while requests wait or are swapped out (their prefills need the
  budget), or when the step's token budget left is below one token for every running sequence
  still to schedule plus the proposal.

A proposal is also dropped when its slots would need blocks the pool does not have free (above
the watermark): speculation never preempts anything.

``record`` takes a step's verdict (how many of the proposed tokens were accepted) and counts it
per position in the scheduler's stats for ``/metrics`` (``spec_proposed[j]``,
``spec_accepted[j]``: drafts at position ``j``).
"""

from __future__ import annotations

import math

import structlog

from shared.speculative import SpeculativeConfig

from .block_manager import BlockManager
from .ngram import NgramProposer
from .sequence import Sequence
from .stats import SchedulerStats

STEP_ROWS = 16  # a step's rows that speculation may fill (see above)
MIN_RATE = 0.2  # acceptance below which a sequence pauses speculating (one running)
RATE_PER_SEQ = 0.06  # ... plus this for each other running sequence
PAUSE_STEPS = 16
_DECAY = 0.7  # weight of the past in the acceptance average


def ineligible(seq: Sequence) -> str | None:
    """Why ``seq``'s request decodes without speculation, or None when it may speculate."""
    p = seq.sampling
    if p.logprobs is not None:
        return "logprobs"
    if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        return "penalties"
    if p.min_tokens:
        return "min_tokens"
    if p.guided:
        return "structured output"
    if p.use_beam_search or (p.best_of or p.n) > p.n:
        return "beam search or best_of"
    return None


class _Track:
    __slots__ = ("rate", "paused")

    def __init__(self) -> None:
        self.rate, self.paused = 1.0, 0


class Speculator:
    def __init__(self, config: SpeculativeConfig, stats: SchedulerStats, blocks: BlockManager) -> None:
        self.config, self.stats, self.blocks = config, stats, blocks
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        stats.spec_proposed = [0] * self.k  # per draft position, over the engine's life
        stats.spec_accepted = [0] * self.k
        self._tracks: dict[int, _Track] = {}
        self._logged: set[str] = set()
        self.log = structlog.get_logger().bind(component="speculation")

    def drafts(self, seq: Sequence, budget_left: int, num_to_schedule: int, max_model_len: int,
               busy: bool, num_running: int = 1) -> list[int]:
        """The tokens ``seq`` (a decode, its last token known) verifies in its next step; [] for
        none. ``budget_left``: the step's tokens left before ``seq``'s; ``num_to_schedule``: running
        sequences after it that still need one each; ``busy``: requests wait or are swapped;
        ``num_running``: the running sequences."""
        if busy or seq.num_placeholders or seq.num_pending_tokens != 1:
            return []
        reason = ineligible(seq)
        if reason is not None:
            if reason not in self._logged:
                self._logged.add(reason)
                self.log.info("request decodes without speculation", reason=reason, request_id=seq.request_id)
            return []
        track = self._tracks.setdefault(seq.seq_id, _Track())
        if track.paused:
            track.paused -= 1
            return []
        needed = min(0.9, MIN_RATE + RATE_PER_SEQ * (num_running - 1))
        if track.rate < needed:  # not worth its rows at this load: pause, then try again
            track.rate, track.paused = needed, PAUSE_STEPS
            return []
        room = min(self.k, math.ceil(self.k * track.rate),
                   seq.sampling.max_tokens - len(seq.output_token_ids) - 1,  # the accepted + 1 fit
                   max_model_len - seq.num_tokens - 1,
                   budget_left - 1 - num_to_schedule, (STEP_ROWS - num_running) // max(num_running, 1))
        drafts = self.proposer.propose(seq.token_ids, room) if room > 0 else []
        return drafts if drafts and self._fits(seq, len(drafts)) else []

    def wants_lockstep(self, running: list[Sequence], in_flight) -> bool:
        """Whether the next step must wait for the result of the one in flight (async scheduling):
        when that one verifies drafts (how many tokens it adds is known only then), or when a
        running sequence would propose now (a sequence fed a placeholder cannot: its last token is
        not known). Paused and ineligible sequences let async scheduling go on."""
        if in_flight.has_drafts():
            return True
        return any(ineligible(seq) is None and not getattr(self._tracks.get(seq.seq_id), "paused", 0)
                   and self.proposer.propose(seq.token_ids, 1) for seq in running)

    def _fits(self, seq: Sequence, num_drafts: int) -> bool:
        """Whether the blocks for ``num_drafts`` more slots are free (above the watermark)."""
        blocks, start = self.blocks, seq.num_computed_tokens
        needed = blocks.num_new_blocks(seq.seq_id, start + 1 + num_drafts)
        return (needed == blocks.num_new_blocks(seq.seq_id, start + 1)
                or needed + blocks.watermark_blocks <= blocks.num_free_blocks)

    def record(self, seq_id: int, num_proposed: int, num_accepted: int) -> None:
        """A step verified ``num_proposed`` tokens of ``seq_id`` and accepted the first ``num_accepted``."""
        for j in range(num_proposed):
            self.stats.spec_proposed[j] += 1
            self.stats.spec_accepted[j] += j < num_accepted
        track = self._tracks.get(seq_id)
        if track is None:
            return
        track.rate = _DECAY * track.rate + (1 - _DECAY) * (num_accepted / num_proposed)
        if track.rate < MIN_RATE:
            track.rate, track.paused = 1 / self.k, PAUSE_STEPS

    def forget(self, seq_id: int) -> None:
        self._tracks.pop(seq_id, None)
