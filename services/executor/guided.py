"""Structured output on the executor: for each guided sequence, the vocabulary's tokens that keep its
output inside its guide (``shared.structured``), as a ``TokenSet`` the sampler applies last.

``GuidedSequences``: a sequence's state is recomputed from its output tokens (the executor's
``TokenHistories``), so a fork, a recompute, a resumed request or a restarted executor need nothing
of their own; masks are made from the sorted vocabulary (``vocabulary``, from the tokenizer's bytes
for each id: ``token_bytes``) and kept per (guide, state) for the next time the state comes back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shared.structured import Guide, compile_guide

from .histories import TokenHistories
from .token_bytes import token_bytes
from .token_set import TokenSet
from .vocabulary import Vocabulary, load_vocabulary

# ``executor.main`` and ``offline`` import the vocabulary's loaders from here
__all__ = ["GUIDES_KEPT", "MASK_CACHE_SIZE", "GuideUnavailable", "GuidedSequences", "Vocabulary",
           "load_vocabulary", "token_bytes"]

MASK_CACHE_SIZE = 1024  # masks kept per guide (a few KiB each: ids, not a bit per token)
GUIDES_KEPT = 32  # guides kept for their masks after their last sequence, the least recently used dropped


class GuideUnavailable(RuntimeError):
    """The executor cannot guide (its tokenizer did not load): the guided requests fail, alone."""


@dataclass
class _Tracked:
    guide: Guide
    masks: OrderedDict  # state -> mask, shared by every sequence with the same guide
    state: tuple | None  # after ``consumed`` output tokens; None once they left the guide
    consumed: int = 0


class GuidedSequences:
    """The guided sequences of one executor. ``vocabulary`` is made on first use by
    ``load_vocabulary`` (the tokenizer's bytes for every id up to the model's vocabulary size)."""

    def __init__(self, histories: TokenHistories, load_vocabulary: Callable[[], Vocabulary] | None = None) -> None:
        self.histories = histories
        self.load_vocabulary = load_vocabulary
        self._vocabulary: Vocabulary | None = None
        self._failure: str | None = None
        self._guides: OrderedDict[str, tuple[Guide, OrderedDict]] = OrderedDict()
        self._seqs: dict[int, _Tracked] = {}

    @property
    def vocabulary(self) -> Vocabulary:
        """Loaded on first use; a failure is kept (``GuideUnavailable`` each time, no second try)."""
        if self._vocabulary is None:
            if self._failure is not None:
                raise GuideUnavailable(self._failure)
            try:
                if self.load_vocabulary is None:
                    raise RuntimeError("this executor has no tokenizer to guide with")
                self._vocabulary = self.load_vocabulary()
            except Exception as exc:  # a tokenizer that cannot load: ValueError, OSError...
                self._failure = f"no vocabulary to guide with: {exc}"
                raise GuideUnavailable(self._failure) from None
        return self._vocabulary

    def add(self, seq_id: int, spec: str) -> None:
        if spec not in self._guides:
            self._guides[spec] = (compile_guide(spec), OrderedDict())
            if len(self._guides) > GUIDES_KEPT:  # its live sequences keep theirs
                self._guides.popitem(last=False)
        self._guides.move_to_end(spec)
        guide, masks = self._guides[spec]
        self._seqs[seq_id] = _Tracked(guide, masks, guide.initial())

    def remove(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def clear(self) -> None:
        self._seqs.clear()

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def mask(self, seq_id: int, eos_token_ids: list[int]) -> TokenSet:
        """What the sequence may sample next; once its guide is complete, the EOS ids too (alone,
        when nothing may follow). A sequence whose output has left its guide (it cannot, unless
        its outputs came from elsewhere) may only end."""
        tracked = self._seqs[seq_id]
        state = self._state(seq_id, tracked)
        vocab = self.vocabulary
        if state is None:
            allowed = TokenSet(True, np.zeros(0, np.int64))
        else:
            allowed = self._cached(tracked, state)
        if state is None or tracked.guide.is_complete(state) or allowed.empty:
            allowed = allowed.adding([t for t in eos_token_ids if 0 <= t < vocab.size])
        return allowed

    def _cached(self, tracked: _Tracked, state: tuple) -> TokenSet:
        """The state's mask, from the cache or made and kept; in a string with length bounds, made
        from the same string's unbounded mask (``Guide.bounded_string``) and the tokens' lengths."""
        allowed = tracked.masks.get(state)
        if allowed is not None:
            tracked.masks.move_to_end(state)
            return allowed
        vocab = self.vocabulary
        bounded = tracked.guide.bounded_string(state)
        if bounded is None:
            mask = vocab.allowed(tracked.guide, state)
        else:
            free, chars, low, high = bounded
            mask = self._cached(tracked, free).as_mask(vocab.size)
            written = chars + vocab.string_chars
            if high >= 0:
                mask &= written <= high
            mask &= ~vocab.closes_string | (written >= low)
        allowed = tracked.masks[state] = TokenSet.from_mask(mask)
        if len(tracked.masks) > MASK_CACHE_SIZE:
            tracked.masks.popitem(last=False)
        return allowed

    def _state(self, seq_id: int, tracked: _Tracked) -> tuple | None:
        outputs = self.histories.token_ids(seq_id)[self.histories.num_prompt_tokens(seq_id):]
        if tracked.consumed > len(outputs):  # fewer outputs than before: start again from them
            tracked.state, tracked.consumed = tracked.guide.initial(), 0
        state = tracked.state
        pieces = self.vocabulary.pieces
        for token in outputs[tracked.consumed:]:
            if state is None:
                break
            piece = pieces[token] if 0 <= token < len(pieces) else None
            state = tracked.guide.advance_bytes(state, piece) if piece else None
        tracked.state, tracked.consumed = state, len(outputs)
        return state
