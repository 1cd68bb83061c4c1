"""Logprobs in OpenAI's two shapes: the legacy completions object and chat's ``content`` list.

Each generated token carries its logprob and the most likely tokens at its position (from the
model's raw distribution, see ``services/executor/sampler.py``). Tokens are shown as their own
decoded text (special tokens included); chat's ``bytes`` are the token's exact bytes when the
tokenizer is byte-level (a token may hold part of a UTF-8 character), else its text's UTF-8.
Echoed prompt tokens have ``null`` logprobs (prompt logprobs are not computed). When a stop
string ends a choice, its logprobs run to the token that completed the stop string, although the
text is cut before it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None for an echoed prompt token
    top: tuple[tuple[int, float], ...] | None = None  # (token id, logprob), most likely first


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character that stands for each byte -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenFormatter:
    """Token ids -> text and bytes for logprobs, cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self.text = functools.lru_cache(maxsize=65536)(self._text)
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if isinstance(piece, str) and piece and all(c in decoder for c in piece) and token_id not in self._special_ids:
            return [decoder[c] for c in piece]
        return list(self.text(token_id).encode())

    # ---------------------------------------------------------------- the two shapes

    def completion(self, entries: list[TokenLogprob], text_offset: int) -> tuple[dict[str, Any], int]:
        """The legacy ``logprobs`` object for ``entries``, whose text starts at ``text_offset``
        characters into the choice's text; returns it and the offset after these tokens."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            text = self.text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top_logprobs.append(None if entry.logprob is None else self._top_dict(entry))
            offsets.append(text_offset)
            text_offset += len(text)
        body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}
        return body, text_offset

    def _top_dict(self, entry: TokenLogprob) -> dict[str, float]:
        """Text -> logprob of the most likely tokens and, as OpenAI's legacy API does, of the
        sampled one (so up to k + 1 entries); of two tokens with one text the likelier stays."""
        out: dict[str, float] = {}
        for token_id, logprob in (*(entry.top or ()), (entry.token_id, entry.logprob)):
            out.setdefault(self.text(token_id), logprob)
        return out

    def chat(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """Chat's ``logprobs`` object: ``{"content": [...], "refusal": null}``."""
        content = []
        for entry in entries:
            item = self._chat_token(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._chat_token(t, lp) for t, lp in entry.top or ()]
            content.append(item)
        return {"content": content, "refusal": None}

    def _chat_token(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        return {"token": self.text(token_id), "logprob": logprob, "bytes": self.bytes(token_id)}
