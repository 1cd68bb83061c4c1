"""Each live sequence's token ids on the executor, for the sampler's penalties and min_tokens.

A sequence's history starts with what its ``NewSequence`` carried (its prompt, and the outputs so
far of a forked beam) and grows with each step's input tokens at positions past its end: a decode
feeds back the token sampled last, a chunked prefill its next chunk, a re-prefill after a
recompute preemption only what was never fed before. Tokens at positions already known (a
prefix-cache hit is never fed; a recompute feeds everything again) change nothing, unless the
token differs: then the history is cut there and takes the step's tokens. That is speculative
decoding's rollback: a step feeds proposed tokens (``Step.num_draft_tokens``) that enter the
history like any other, and when some were rejected the next step feeds the token sampled in
place of the first rejected one, at its position.
"""

from __future__ import annotations

import numpy as np

from shared.messages import NewSequence, Step


class TokenHistories:
    """``seq_id`` -> its token ids so far, and how many of them are prompt."""

    def __init__(self) -> None:
        self._token_ids: dict[int, list[int]] = {}
        self._num_prompt_tokens: dict[int, int] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._token_ids

    def __len__(self) -> int:
        return len(self._token_ids)

    def add(self, new: NewSequence) -> None:
        self._token_ids[new.seq_id] = np.asarray(new.token_ids).tolist()
        self._num_prompt_tokens[new.seq_id] = new.num_prompt_tokens

    def remove(self, seq_id: int) -> None:
        self._token_ids.pop(seq_id, None)
        self._num_prompt_tokens.pop(seq_id, None)

    def clear(self) -> None:
        self._token_ids.clear()
        self._num_prompt_tokens.clear()

    def observe(self, step: Step) -> None:
        """Extend the scheduled sequences' histories with the step's tokens past their ends.

        Raises ``ValueError`` if a step feeds a known sequence a position beyond its end (a gap:
        the scheduler and the executor disagree about what the sequence holds)."""
        starts = step.query_start_loc.tolist()
        positions, token_ids = step.positions, step.input_token_ids
        for i, seq_id in enumerate(step.seq_ids.tolist()):
            begin, end = starts[i], starts[i + 1]
            history = self._token_ids.get(seq_id)
            if history is None or begin == end:
                continue
            first = int(positions[begin])
            if first > len(history):
                raise ValueError(f"step {step.step_id} feeds sequence {seq_id} from position {first}, "
                                 f"but only {len(history)} of its tokens are known")
            overlap = min(len(history) - first, end - begin)
            if overlap > 0 and history[first:first + overlap] != token_ids[begin:begin + overlap].tolist():
                del history[first:]  # it differs from what was proposed there: the rejected drafts go
            if first + (end - begin) > len(history):
                history.extend(token_ids[begin + len(history) - first:end].tolist())

    def token_ids(self, seq_id: int) -> list[int]:
        """Every token of ``seq_id`` known so far ([] for an unknown sequence)."""
        return self._token_ids.get(seq_id, [])

    def num_prompt_tokens(self, seq_id: int) -> int:
        return self._num_prompt_tokens.get(seq_id, 0)

    def num_output_tokens(self, seq_id: int) -> int:
        """Outputs known so far: at sampling time, how many tokens the sequence has generated."""
        return len(self.token_ids(seq_id)) - self.num_prompt_tokens(seq_id)
