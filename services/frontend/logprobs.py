"""Logprobs: the engine's (``RequestOutput``) as entries, and the entries in OpenAI's two shapes,
the legacy completions object and chat's ``content`` list, and in vLLM's ``prompt_logprobs``.

Each generated token carries its logprob and the most likely tokens at its position (from the
model's raw distribution, see ``services/executor/sampler.py``); so does each prompt token after
the first when the engine scored the prompt (``prompt_entries``; the first has ``null``, having
nothing before it). Tokens are shown as their own decoded text (special tokens included); chat's
``bytes`` are the token's exact bytes when the tokenizer is byte-level (a token may hold part of a
UTF-8 character), else its text's UTF-8. When a stop string ends a choice, its logprobs run to the
token that completed the stop string, although the text is cut before it. JSON has no -Infinity:
such a logprob is shown as ``MIN_LOGPROB``, as OpenAI and vLLM do.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

from shared.messages import RequestOutput

MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None for a prompt token without one (the first, or an unscored prompt)
    top: tuple[tuple[int, float], ...] | None = None  # (token id, logprob), most likely first
    rank: int | None = None  # of a scored prompt token: 1 + how many tokens were likelier


# ---------------------------------------------------------------- the engine's logprobs as entries


def token_entries(output: RequestOutput) -> list[TokenLogprob]:
    """The logprobs the scheduler attached, one per new token (a token without any gets None)."""
    entries = []
    tokens = output.new_token_ids
    offset = len(tokens) - len(output.logprobs)  # the scheduler attaches them to the last tokens
    for i, token_id in enumerate(tokens):
        j = i - offset
        if j < 0:
            entries.append(TokenLogprob(token_id, None, ()))
            continue
        top = tuple((t, _finite(v)) for t, v in zip(output.top_token_ids[j], output.top_logprobs[j]))
        entries.append(TokenLogprob(token_id, _finite(output.logprobs[j]), top))
    return entries


def prompt_entries(prompt_token_ids: list[int], output: RequestOutput | None) -> list[TokenLogprob]:
    """One entry per prompt token: the first ``null``, the others with the scores ``output``
    carries (``RequestOutput.prompt_logprobs``); all ``null`` without them."""
    entries = [TokenLogprob(t, None, None) for t in prompt_token_ids]
    if output is None or len(output.prompt_logprobs) != len(prompt_token_ids) - 1:
        return entries
    for i, token_id in enumerate(prompt_token_ids[1:]):
        top = tuple((t, _finite(v)) for t, v in zip(output.prompt_top_token_ids[i], output.prompt_top_logprobs[i]))
        entries[i + 1] = TokenLogprob(token_id, _finite(output.prompt_logprobs[i]), top, output.prompt_ranks[i])
    return entries


def with_top(entries: list[TokenLogprob], num_top: int) -> list[TokenLogprob]:
    """``entries`` with at most ``num_top`` most likely tokens each (the engine sends the most any
    view of them asked for)."""
    return [e if e.top is None else dataclasses.replace(e, top=e.top[:num_top]) for e in entries]


def _finite(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


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

    def vllm_prompt(self, entries: list[TokenLogprob]) -> list[dict[int, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token, ``null`` without a logprob (the first),
        else ``{token id: {"logprob", "rank", "decoded_token"}}`` for the prompt token, then for
        each of the most likely tokens (rank 1, 2, ...) that is not the prompt token."""
        out: list[dict[int, dict[str, Any]] | None] = []
        for entry in entries:
            if entry.logprob is None:
                out.append(None)
                continue
            ranked = {entry.token_id: self._vllm_token(entry.token_id, entry.logprob, entry.rank)}
            for rank, (token_id, logprob) in enumerate(entry.top or (), start=1):
                if token_id not in ranked:
                    ranked[token_id] = self._vllm_token(token_id, logprob, rank)
            out.append(ranked)
        return out

    def _vllm_token(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.text(token_id)}

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
