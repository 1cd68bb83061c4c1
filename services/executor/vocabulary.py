"""The sorted vocabulary a guide's masks are made from (``guided``).

``Vocabulary``: each token id's bytes (``token_bytes``), special tokens left out, sorted so that the
tokens sharing a prefix are one range (a trie without nodes). ``allowed`` walks it from the guide's
state one byte column at a time, dropping a range as soon as its next byte is refused, and taking a
whole range at once when the guide is inside a string and every token of the range writes only plain
string bytes within the string's budget (most of the vocabulary, most of the time).
"""

from __future__ import annotations

import time

import numpy as np

from shared.model_source import ModelSource
from shared.structured import Guide
from shared.structured.guide import utf8_suffix_start

from .token_bytes import token_bytes

_SMALL_RANGE = 16  # below this many tokens, a range's bytes are read in Python rather than numpy


class Vocabulary:
    """The tokens' bytes, sorted: ``order[k]`` is the id of the k-th smallest, ``columns[k, d]`` its
    d-th byte (-1 past its end). Per token: its length, the position from which its bytes are plain
    string bytes (no '"', '\\' or control byte, well-formed UTF-8: a string takes them as they are)
    and its number of characters (bytes that do not continue a UTF-8 sequence)."""

    def __init__(self, pieces: list[bytes | None]) -> None:
        self.size = len(pieces)
        self.pieces = pieces
        ids = [i for i, b in enumerate(pieces) if b]
        ids.sort(key=lambda i: pieces[i])
        self.order = np.asarray(ids, np.int64)
        self.texts = [pieces[i] for i in ids]
        width = max((len(t) for t in self.texts), default=1)
        self.lengths = np.asarray([len(t) for t in self.texts], np.int64)
        self.columns = np.full((len(ids), width), -1, np.int16)
        for k, text in enumerate(self.texts):
            self.columns[k, : len(text)] = np.frombuffer(text, np.uint8)
        unsafe = (self.columns == 0x22) | (self.columns == 0x5C) | ((self.columns >= 0) & (self.columns < 0x20))
        after_unsafe = np.where(unsafe, np.arange(width) + 1, 0).max(axis=1)
        # from where on a token is plain string bytes: no '"', '\\' or control byte, well-formed UTF-8
        self.plain_from = np.maximum(after_unsafe, [utf8_suffix_start(t) for t in self.texts])
        starts = (self.columns >= 0) & ((self.columns < 0x80) | (self.columns >= 0xC0))
        self.chars = starts.sum(axis=1)
        self._starts = starts
        # by id: the characters each token writes inside a string before closing it, and whether it does
        self.string_chars = np.zeros(self.size, np.int64)
        self.closes_string = np.zeros(self.size, bool)
        for token_id, text in zip(ids, self.texts):
            self.string_chars[token_id], self.closes_string[token_id] = _string_run(text)

    def allowed(self, guide: Guide, state: tuple) -> np.ndarray:
        """[size] bool: the tokens whose bytes ``guide`` takes from ``state``."""
        mask = np.zeros(self.size, bool)
        if not guide.can_continue(state):
            return mask
        chosen: list[np.ndarray] = []
        work = [(0, len(self.texts), 0, state)]
        columns, texts = self.columns, self.texts
        while work:
            lo, hi, depth, here = work.pop()
            if depth:
                # tokens that end here are allowed (sorted first in their range)
                while lo < hi and self.lengths[lo] == depth:
                    chosen.append(self.order[lo:lo + 1])
                    lo += 1
                if lo == hi:
                    continue
                budget = guide.free_string_budget(here)
                if budget is not None and self.plain_from[lo:hi].max() <= depth:
                    chosen.append(self._within(lo, hi, depth, budget))
                    continue
            if hi - lo <= _SMALL_RANGE:
                groups = _groups_small(texts, lo, hi, depth)
            else:
                groups = _groups(columns[lo:hi, depth], lo)
            for byte, start, end in groups:
                after = guide.advance(here, byte)
                if after is not None:
                    work.append((start, end, depth + 1, after))
        if chosen:
            mask[np.concatenate(chosen)] = True
        return mask

    def _within(self, lo: int, hi: int, depth: int, budget: float) -> np.ndarray:
        """The ids in [lo, hi) (tokens longer than ``depth`` sharing their first ``depth`` bytes,
        and only plain string bytes after them) that write at most ``budget`` more characters."""
        if budget == float("inf"):
            return self.order[lo:hi]
        before = int(self._starts[lo, :depth].sum())
        return self.order[lo:hi][self.chars[lo:hi] - before <= budget]


def _string_run(data: bytes) -> tuple[int, bool]:
    """Read from between two characters of a string: the characters ``data`` writes before the
    quote that closes the string (an escape is one, a surrogate pair of escapes one, a UTF-8
    character one), and whether it closes it."""
    chars, at = 0, 0
    while at < len(data):
        byte = data[at]
        if byte == 0x22:
            return chars, True
        if byte == 0x5C:
            chars += 1
            if data[at + 1:at + 2] == b"u":
                digits = data[at + 2:at + 6]
                at += 6
                if digits[:1] in (b"d", b"D") and digits[1:2] in (b"8", b"9", b"a", b"b", b"A", b"B") \
                        and data[at:at + 2] == b"\\u":
                    at += 6  # the low half of a surrogate pair: the same character
            else:
                at += 2
            continue
        chars += not 0x80 <= byte < 0xC0
        at += 1
    return chars, False


def _groups(column: np.ndarray, offset: int) -> list[tuple[int, int, int]]:
    """(byte, start, end) for each run of equal bytes in a sorted column (no -1 left in it)."""
    cuts = np.flatnonzero(column[1:] != column[:-1]) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(column)]))
    values = column[starts]
    return [(int(v), int(s) + offset, int(e) + offset) for v, s, e in zip(values, starts, ends)]


def _groups_small(texts: list[bytes], lo: int, hi: int, depth: int) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for k in range(lo, hi):
        byte = texts[k][depth]
        if out and out[-1][0] == byte:
            out[-1] = (byte, out[-1][1], k + 1)
        else:
            out.append((byte, k, k + 1))
    return out


def load_vocabulary(tokenizer: str | None, model: ModelSource, vocab_size: int, log=None) -> Vocabulary:
    """The sorted vocabulary of ``tokenizer`` (a ``--tokenizer`` value) or else ``model``'s tokenizer,
    over ``vocab_size`` ids (the model's): made on the first guided request, about 0.3 s for 49k tokens."""
    from shared.model_source import load_tokenizer, resolve_tokenizer

    start = time.monotonic()
    source = resolve_tokenizer(tokenizer, model)
    vocabulary = Vocabulary(token_bytes(load_tokenizer(source, "--tokenizer" if tokenizer else "--model"), vocab_size))
    if log is not None:
        log.info("guided decoding ready", tokenizer=source.where, tokens=len(vocabulary.texts),
                 seconds=round(time.monotonic() - start, 2))
    return vocabulary
