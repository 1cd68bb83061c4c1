"""Each token id's bytes, as the detokenizer writes them: from the tokenizer's pieces (byte-level BPE,
SentencePiece byte fallback), or each token decoded alone. Special tokens have none (``Vocabulary``
leaves them out; a guide's end allows the EOS ids instead)."""

from __future__ import annotations

import json


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
