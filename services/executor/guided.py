"""Structured output on the executor: for each guided sequence, the vocabulary's tokens that keep its
output inside its guide (``shared.structured``), as a boolean mask the sampler applies last.

``Vocabulary``: each token id's bytes (from the tokenizer: byte-level BPE, SentencePiece byte
fallback, or each token decoded alone), special tokens left out, sorted so that the tokens sharing a
prefix are one range (a trie without nodes). ``allowed`` walks it from the guide's state one byte
column at a time, dropping a range as soon as its next byte is refused, and taking a whole range
at once when the guide is inside a string and every token of the range writes only plain string
bytes within the string's budget (most of the vocabulary, most of the time).

``GuidedSequences``: a sequence's state is recomputed from its output tokens (the executor's
``TokenHistories``), so a fork, a recompute, a resumed request or a restarted executor need nothing
of their own; masks are kept per (guide, state) for the next time the state comes back.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shared.model_source import ModelSource
from shared.structured import Guide, compile_guide
from shared.structured.guide import utf8_suffix_start

from .histories import TokenHistories

MASK_CACHE_SIZE = 1024  # masks kept per guide (a few KiB each: ids, not a bit per token)
GUIDES_KEPT = 32  # guides kept for their masks after their last sequence, the least recently used dropped
_SMALL_RANGE = 16  # below this many tokens, a range's bytes are read in Python rather than numpy


# ---------------------------------------------------------------- token ids -> bytes


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-ins for the 256 byte values (byte-level BPE writes tokens in them)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _decoder_kinds(tokenizer) -> set[str]:
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except Exception:  # a slow tokenizer, or one without a backend
        return set()
    kinds = {spec.get("type")}
    for part in spec.get("decoders") or []:
        kinds.add(part.get("type"))
    return kinds


def token_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """Each id's bytes as the detokenizer writes them, None for special tokens and ids the tokenizer
    does not know (they are never allowed; a guide's end allows the EOS ids instead)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    added_ids = set()  # added tokens: their bytes are whatever the tokenizer decodes them to
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        added_ids.add(token_id)
        if getattr(added, "special", False):
            special.add(token_id)
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    kinds = _decoder_kinds(tokenizer)
    out: list[bytes | None] = [None] * vocab_size
    if "ByteLevel" in kinds:
        alphabet = _byte_level_alphabet()
        for i, piece in enumerate(pieces):
            if i in special or piece is None:
                continue
            if i in added_ids:  # written by the decoder as it writes them (not always as their text)
                out[i] = tokenizer.decode([i]).encode()
                continue
            try:
                out[i] = bytes(alphabet[c] for c in piece)
            except KeyError:  # a piece outside the alphabet: taken as text
                out[i] = piece.encode()
        return out
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            continue
        if "ByteFallback" in kinds and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[i] = bytes([int(piece[3:5], 16)])
        elif "Metaspace" in kinds or "Replace" in kinds or "▁" in piece:
            out[i] = piece.replace("▁", " ").encode()
        else:
            text = tokenizer.decode([i])
            out[i] = None if "\ufffd" in text else text.encode()
    return out


# ---------------------------------------------------------------- the sorted vocabulary


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


# ---------------------------------------------------------------- per sequence


class GuideUnavailable(RuntimeError):
    """The executor cannot guide (its tokenizer did not load): the guided requests fail, alone."""


@dataclass(frozen=True)
class TokenSet:
    """The ids a guided row may take: ``ids`` when ``keep``, else every id but ``ids`` (whichever
    list is the shorter; most states allow a few hundred tokens or all but a few hundred)."""

    keep: bool
    ids: np.ndarray  # int64, sorted, unique

    @classmethod
    def from_mask(cls, mask: np.ndarray) -> "TokenSet":
        allowed = int(mask.sum())
        return cls(True, np.flatnonzero(mask)) if 2 * allowed <= mask.size else cls(False, np.flatnonzero(~mask))

    @property
    def empty(self) -> bool:
        return self.keep and not len(self.ids)

    def adding(self, token_ids: list[int]) -> "TokenSet":
        extra = np.asarray(token_ids, np.int64)
        if self.keep:
            return TokenSet(True, np.union1d(self.ids, extra))
        return TokenSet(False, np.setdiff1d(self.ids, extra))

    def only_among(self, token_ids: list[int]) -> bool:
        """Whether every allowed id is one of ``token_ids`` (false for a set of all but a few)."""
        return self.keep and bool(np.isin(self.ids, token_ids).all())

    def as_mask(self, size: int) -> np.ndarray:
        ids = self.ids[self.ids < size]
        mask = np.zeros(size, bool) if self.keep else np.ones(size, bool)
        mask[ids] = self.keep
        return mask


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
