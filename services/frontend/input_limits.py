"""Size limits on a request's input that hold before any tokenization: the body's bytes and each
prompt's characters, both derived from ``max_model_len`` and the tokenizer's longest token.

A token covers at most ``max_token_chars`` characters of text, the length of the longest token
string in the vocabulary (byte-level BPE writes one character per byte, so it is the longest
token's bytes; SentencePiece writes its text, a space as one "▁"). So a prompt of more than
``max_model_len * max_token_chars`` characters has more than ``max_model_len`` tokens and cannot
fit: it is refused at once, without tokenizing. (For a tokenizer whose normalizer deletes
characters the bound is not a proof, only a documented cap on characters, far above any prompt
that fits.) A chat counts the characters of its messages' contents (the template only adds).

The body limit leaves room for a prompt of that many characters written the worst way JSON
allows (``\\u00XX``: six bytes per character), with a floor for everything else in a body.
"""

from __future__ import annotations

from typing import Any

from services.frontend.errors import bad_request

JSON_BYTES_PER_CHAR = 6  # "\\u00XX" is the longest JSON spelling of one UTF-8 byte
MIN_BODY_BYTES = 1 << 20


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest token string of ``tokenizer`` (special and added tokens included)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if isinstance(t, str)), default=1) or 1


def max_prompt_chars(max_model_len: int, max_token_chars: int) -> int:
    """The most characters a prompt of ``max_model_len`` tokens can have."""
    return max_model_len * max_token_chars


def body_limit_bytes(max_model_len: int, max_token_chars: int) -> int:
    """The request body limit for this model: its longest possible prompt, JSON-escaped, or the floor."""
    return max(MIN_BODY_BYTES, JSON_BYTES_PER_CHAR * max_prompt_chars(max_model_len, max_token_chars))


def chat_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(m["content"]) for m in messages)


def check_prompt_chars(num_chars: int, max_model_len: int, max_token_chars: int, param: str) -> None:
    """A 400 when a prompt of ``num_chars`` characters cannot fit in ``max_model_len`` tokens."""
    limit = max_prompt_chars(max_model_len, max_token_chars)
    if num_chars > limit:
        raise bad_request(
            f"The prompt has {num_chars} characters and the limit is {limit} characters: max_model_len "
            f"{max_model_len} tokens x {max_token_chars}, the most characters one token of this model covers; "
            f"shorten the prompt.",
            param,
            "context_length_exceeded",
        )
