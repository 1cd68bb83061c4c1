"""Structured output on the executor: for each guided sequence, the tokens that keep its output
inside its guide (a ``shared.structured`` spec, an llguidance grammar), as a ``TokenSet`` the
sampler applies last.

``GuidedSequences`` holds one ``llguidance.LLMatcher`` per sequence over the executor's tokenizer
(``load_vocabulary``: ``llguidance.hf.from_tokenizer`` over the model's vocabulary size). A
sequence's state is its output tokens (the executor's ``TokenHistories``): the matcher consumes the
new ones before each mask, and starts again from them when there are fewer than before, so a fork,
a recompute, a resumed request or a restarted executor need nothing of their own.

``masks`` takes every guided row of a step at once: with more than one to fill it fills their
bitmasks in one call, ``llguidance.numpy.fill_next_token_bitmask_par`` with an ``LLExecutor`` over
torch's threads (idle between the forward pass and the sampling), so llguidance computes them in
native threads without the GIL; one row goes the single path, ``mask``. The masks are the same.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.hub_kernels import hide_hub_kernels
from shared.model_source import ModelSource
from shared.structured import compile_guide

from .histories import TokenHistories
from .token_set import TokenSet

__all__ = ["GUIDES_KEPT", "GuideUnavailable", "GuidedSequences", "load_vocabulary", "vocabulary_of"]

GUIDES_KEPT = 32  # compiled matchers kept per spec after their last sequence, the least recently used dropped


class GuideUnavailable(RuntimeError):
    """The executor cannot guide (its tokenizer did not load): the guided requests fail, alone."""


@dataclass
class _Tracked:
    spec: str
    matcher: Any = None  # llguidance.LLMatcher, made at the first mask
    consumed: int = 0  # output tokens it has consumed
    left: bool = False  # an output token outside the vocabulary: the guide is left


def vocabulary_of(tokenizer, vocab_size: int):
    """llguidance's view of a Hugging Face tokenizer, over the model's ``vocab_size`` ids."""
    hide_hub_kernels()  # llguidance.hf imports transformers
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)


def load_vocabulary(tokenizer: str | None, model: ModelSource, vocab_size: int, log=None):
    """``vocabulary_of`` the tokenizer ``tokenizer`` names (a ``--tokenizer`` value), or else
    ``model``'s: made on the first guided request."""
    from shared.model_source import load_tokenizer, resolve_tokenizer

    start = time.monotonic()
    source = resolve_tokenizer(tokenizer, model)
    vocabulary = vocabulary_of(load_tokenizer(source, "--tokenizer" if tokenizer else "--model"), vocab_size)
    if log is not None:
        log.info("guided decoding ready", tokenizer=source.where, tokens=vocab_size,
                 seconds=round(time.monotonic() - start, 2))
    return vocabulary


def _reraise_interrupts(exc: BaseException) -> None:
    """llguidance's panics come as pyo3's PanicException, a BaseException: those are caught, not these."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise exc


def _set_bits(words: np.ndarray, token_ids: list[int], value: bool) -> None:
    for token in token_ids:
        bit = np.uint32(1 << (token & 31))
        words[token >> 5] = words[token >> 5] | bit if value else words[token >> 5] & ~bit


def token_set(words: np.ndarray, size: int) -> TokenSet:
    """The ``TokenSet`` of a little-endian bitmask (``size`` tokens in uint32 words): the allowed ids
    or the refused ones, whichever has fewer non-zero words, read from those words alone (most masks
    allow a few tokens, or all but a few); a mask of neither kind through a boolean array."""
    refused = ~words
    on, off = np.flatnonzero(words), np.flatnonzero(refused)
    keep = len(on) <= len(off)
    nonzero, bits = (on, words) if keep else (off, refused)
    if len(nonzero) > len(words) // 4:
        return TokenSet.from_mask(np.unpackbits(words.view(np.uint8), bitorder="little")[:size].view(bool))
    rows, columns = np.nonzero(np.unpackbits(bits[nonzero].view(np.uint8), bitorder="little").reshape(-1, 32))
    ids = nonzero[rows] * 32 + columns
    return TokenSet(keep, ids[ids < size].astype(np.int64))


def token_sets(words: np.ndarray, size: int) -> list[TokenSet]:
    """``token_set`` of each row of a ``(rows, size / 32)`` bitmask, read all at once."""
    on = np.count_nonzero(words, axis=1)
    off = np.count_nonzero(words != np.uint32(0xFFFFFFFF), axis=1)
    keep = on <= off
    dense = np.where(keep, on, off) > words.shape[1] // 4
    out: list[TokenSet | None] = [None] * len(words)
    sparse = np.flatnonzero(~dense)
    bits = np.where(keep[sparse, None], words[sparse], ~words[sparse])
    rows, columns = np.nonzero(bits)
    set_rows, set_bits = np.nonzero(np.unpackbits(bits[rows, columns].view(np.uint8), bitorder="little").reshape(-1, 32))
    ids, owners = columns[set_rows] * 32 + set_bits, rows[set_rows]
    if size % 32:  # bits past the vocabulary, in its last word
        ids, owners = ids[ids < size], owners[ids < size]
    ids = ids.astype(np.int64, copy=False)
    bounds = np.searchsorted(owners, np.arange(len(sparse) + 1))
    for k, row in enumerate(sparse.tolist()):
        out[row] = TokenSet(bool(keep[row]), ids[bounds[k]:bounds[k + 1]])
    for row in np.flatnonzero(dense).tolist():
        out[row] = TokenSet.from_mask(np.unpackbits(words[row].view(np.uint8), bitorder="little")[:size].view(bool))
    return out


def _only(eos: list[int]) -> TokenSet:
    return TokenSet(True, np.asarray(sorted(set(eos)), np.int64))


class GuidedSequences:
    """The guided sequences of one executor. ``vocabulary`` (an ``llguidance.LLTokenizer``) is made
    on first use by ``load_vocabulary``."""

    def __init__(self, histories: TokenHistories, load_vocabulary: Callable[[], Any] | None = None) -> None:
        self.histories = histories
        self.load_vocabulary = load_vocabulary
        self._vocabulary: Any = None
        self._failure: str | None = None
        self._guides: OrderedDict[str, Any] = OrderedDict()  # spec -> a fresh matcher, copied per sequence
        self._seqs: dict[int, _Tracked] = {}
        self._bitmask: np.ndarray | None = None
        self._executor: Any = None  # llguidance.LLExecutor, for masks in a batch

    @property
    def vocabulary(self):
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
        """Follow ``spec`` for ``seq_id`` (the matcher is made at its first mask)."""
        self._seqs[seq_id] = _Tracked(spec)

    def remove(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def clear(self) -> None:
        self._seqs.clear()

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def mask(self, seq_id: int, eos_token_ids: list[int]) -> TokenSet:
        """What the sequence may sample next; once its guide accepts the output, the EOS ids too
        (alone, when nothing may follow). A sequence whose output has left its guide (it cannot,
        unless its outputs came from elsewhere) may only end."""
        import llguidance.numpy

        tracked, matcher, eos, ended = self._ready(seq_id, eos_token_ids)
        if ended is not None:
            return ended
        if self._bitmask is None:
            self._bitmask = llguidance.numpy.allocate_token_bitmask(1, self.vocabulary.vocab_size)
        try:
            llguidance.numpy.fill_next_token_bitmask(matcher, self._bitmask, 0)
        except BaseException as exc:  # noqa: BLE001 - a panic inside llguidance: the sequence may only end
            _reraise_interrupts(exc)
            tracked.left = True
            return _only(eos)
        return self._token_set(self._bitmask[0], matcher, eos)

    def masks(self, rows: list[tuple[int, list[int]]]) -> list[TokenSet | GuideUnavailable]:
        """``mask`` of each ``(seq_id, eos_token_ids)``, filled together (see the module's docstring);
        a row that cannot be guided gets its ``GuideUnavailable``."""
        out: list[TokenSet | GuideUnavailable | None] = [None] * len(rows)
        pending = []  # (row, tracked, matcher, eos) whose masks llguidance fills
        for row, (seq_id, eos_token_ids) in enumerate(rows):
            try:
                tracked, matcher, eos, out[row] = self._ready(seq_id, eos_token_ids)
            except GuideUnavailable as exc:
                out[row] = exc
                continue
            if out[row] is None:
                pending.append((row, tracked, matcher, eos))
        if len(pending) == 1:
            row, *_ = pending[0]
            out[row] = self.mask(*rows[row])
        elif pending:
            self._fill_together(pending, rows, out)
        return out

    def _fill_together(self, pending: list, rows: list, out: list) -> None:
        import llguidance
        import llguidance.numpy

        if self._executor is None:
            import torch

            self._executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
        bitmask = llguidance.numpy.allocate_token_bitmask(len(pending), self.vocabulary.vocab_size)
        try:
            llguidance.numpy.fill_next_token_bitmask_par(
                self._executor, [(matcher, k) for k, (_, _, matcher, _) in enumerate(pending)], bitmask)
        except BaseException as exc:  # noqa: BLE001 - a panic inside llguidance: each row alone, to tell which
            _reraise_interrupts(exc)
            for row, *_ in pending:
                out[row] = self.mask(*rows[row])
            return
        words = bitmask.view(np.uint32)
        for k, (_, _, matcher, eos) in enumerate(pending):
            self._settle_eos(words[k], matcher, eos)
        for (row, *_), tokens in zip(pending, token_sets(words, self.vocabulary.vocab_size)):
            out[row] = tokens

    def _ready(self, seq_id: int, eos_token_ids: list[int]):
        """``(tracked, matcher, eos ids, ended)``: the sequence's matcher after its outputs so far,
        and, when it may only end, what it may sample (else None)."""
        tracked = self._seqs[seq_id]
        matcher = self._matcher(tracked, seq_id)
        size = self.vocabulary.vocab_size
        eos = [t for t in eos_token_ids if 0 <= t < size]
        ended = _only(eos) if tracked.left or matcher.is_error() or matcher.is_stopped() else None
        return tracked, matcher, eos, ended

    def _token_set(self, row: np.ndarray, matcher, eos: list[int]) -> TokenSet:
        """A filled bitmask row as the ``TokenSet`` the sampler applies (the EOS ids settled)."""
        words = row.view(np.uint32)
        self._settle_eos(words, matcher, eos)
        return token_set(words, self.vocabulary.vocab_size)

    def _settle_eos(self, words: np.ndarray, matcher, eos: list[int]) -> None:
        """The request's EOS ids instead of the tokenizer's, allowed once the guide accepts (or
        when nothing else is)."""
        _set_bits(words, [t for t in self.vocabulary.eos_tokens if t < self.vocabulary.vocab_size], False)
        if matcher.is_accepting() or not words.any():
            _set_bits(words, eos, True)

    def _matcher(self, tracked: _Tracked, seq_id: int):
        """The sequence's matcher, after every output token so far (made, or reset, as needed)."""
        outputs = self.histories.token_ids(seq_id)[self.histories.num_prompt_tokens(seq_id):]
        if tracked.matcher is None:  # a copy of the spec's compiled matcher
            tracked.matcher = self._compiled(tracked.spec).deep_copy()
        matcher = tracked.matcher
        if tracked.consumed > len(outputs):  # fewer outputs than before: start again from them
            matcher.reset()
            tracked.consumed, tracked.left = 0, False
        new = [int(t) for t in outputs[tracked.consumed:]]
        tracked.consumed = len(outputs)
        if not new or tracked.left or matcher.is_error():
            return matcher
        size = self.vocabulary.vocab_size
        try:
            if not all(0 <= t < size for t in new):
                raise IndexError("an output token outside the vocabulary")
            matcher.consume_tokens(new)
        except BaseException as exc:  # noqa: BLE001 - the guide is left (or llguidance panicked): it may only end
            _reraise_interrupts(exc)
            tracked.left = True
        return matcher

    def _compiled(self, spec: str):
        import llguidance

        if spec not in self._guides:
            try:
                grammar = compile_guide(spec)
            except ValueError as exc:  # the frontend and the offline engine check first: not from them
                raise GuideUnavailable(f"the guide cannot be followed: {exc}") from None
            self._guides[spec] = llguidance.LLMatcher(self.vocabulary, grammar, log_level=0)
            if len(self._guides) > GUIDES_KEPT:  # its live sequences keep their copies
                self._guides.popitem(last=False)
        self._guides.move_to_end(spec)
        return self._guides[spec]
