"""Incremental detokenization equals a full decode; stop strings cut and hold back correctly."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.frontend.detokenizer import IncrementalDetokenizer, window_decoder
from tests.doubles.fake_scheduler import cached_tokenizer

TEXTS = [
    "Hello, world! The quick brown fox.",
    "Emoji: 😀🚀👨‍👩‍👧 and 🇯🇵 flags",
    "中文文本，日本語のテキスト、한국어 텍스트。",
    "Ünïcödé àccents: café, naïve, Ærøskøbing, ąčęėįšųūž",
    "math ∑∫√∞ ≤ ≥ and arrows → ← ⇒; box ┌─┐",
    "code: def f(x):\n    return x ** 2  # ✓\n\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return cached_tokenizer()


def full_decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def incremental(tokenizer, ids: list[int], chunk_sizes: list[int], stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces, pos, k = [], 0, 0
    while pos < len(ids):
        size = chunk_sizes[k % len(chunk_sizes)]
        pieces.append(detok.add(ids[pos:pos + size]))
        pos += size
        k += 1
    pieces.append(detok.finish())
    return pieces, detok


def test_seeded_random_text_spans_match_full_decode(tokenizer):
    rng = random.Random(1234)
    for _ in range(400):
        text = "".join(rng.choice(TEXTS) for _ in range(3))
        ids = tokenizer.encode(text)
        start = rng.randrange(len(ids))  # start anywhere, even mid-character
        ids = ids[start:start + rng.randrange(1, 60)]
        chunks = [rng.randrange(1, 5) for _ in range(8)]
        pieces, detok = incremental(tokenizer, ids, chunks)
        assert "".join(pieces) == full_decode(tokenizer, ids) == detok.text


def test_seeded_random_token_ids_match_full_decode(tokenizer):
    """Arbitrary ids, special tokens included: invalid UTF-8 must come out as a full decode has it."""
    rng = random.Random(99)
    for _ in range(400):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        ids += rng.sample([0, 1, 2], k=rng.randrange(0, 3))
        rng.shuffle(ids)
        pieces, _ = incremental(tokenizer, ids, [rng.randrange(1, 4)])
        assert "".join(pieces) == full_decode(tokenizer, ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(
        alphabet=st.characters(codec="utf-8", categories=("L", "N", "P", "S", "Zs", "So")), min_size=1, max_size=40
    ),
    chunk=st.integers(min_value=1, max_value=4),
)
def test_hypothesis_text_matches_full_decode(text, chunk):
    tokenizer = cached_tokenizer()
    ids = tokenizer.encode(text)
    pieces, _ = incremental(tokenizer, ids, [chunk])
    assert "".join(pieces) == full_decode(tokenizer, ids)


def test_split_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1, "the rocket should take several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🚀"
    assert detok.finish() == ""


def test_partial_character_is_flushed_at_finish(tokenizer):
    ids = tokenizer.encode("a🚀")[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    streamed = detok.add(ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.finish() == full_decode(tokenizer, ids)


# ---------------------------------------------------------------- stop strings


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_stop_string_truncates_and_is_never_sent(tokenizer, chunk):
    text = "one two three STOP four five"
    ids = tokenizer.encode(text)
    pieces, detok = incremental(tokenizer, ids, [chunk], stop=["STOP"])
    assert "".join(pieces) == "one two three "
    assert detok.stopped and detok.text == "one two three "
    assert not any("S" in p for p in pieces)


def test_holdback_releases_at_most_len_minus_one_late(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ["xyz!"])  # holds back 3 characters
    ids = tokenizer.encode("abcdefgh")
    sent = "".join(detok.add([t]) for t in ids)
    assert sent == "abcdefgh"[:-3]
    assert detok.finish() == "fgh"


def test_partial_stop_at_the_end_is_released_at_finish(tokenizer):
    ids = tokenizer.encode("hello ST")
    pieces, detok = incremental(tokenizer, ids, [1], stop=["STOP"])
    assert "".join(pieces) == "hello ST" and not detok.stopped


def test_earliest_of_several_stops_wins(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    pieces, detok = incremental(tokenizer, ids, [1], stop=["delta", " beta", "gamma"])
    assert "".join(pieces) == "alpha"
    assert detok.stopped


def test_stop_inside_one_token_and_multibyte_stop(tokenizer):
    ids = tokenizer.encode("price: 東京 tower")
    pieces, _ = incremental(tokenizer, ids, [1], stop=["京"])
    assert "".join(pieces) == "price: 東"
    ids = tokenizer.encode("internationalization")
    pieces, _ = incremental(tokenizer, ids, [5], stop=["nation"])
    assert "".join(pieces) == "inter"


def test_tokens_after_a_stop_are_ignored(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ["B"])
    assert detok.add(tokenizer.encode("A B C")) == "A "
    assert detok.add(tokenizer.encode(" more")) == ""
    assert detok.finish() == ""
    assert detok.text == "A "


def test_random_stops_match_truncated_full_decode(tokenizer):
    rng = random.Random(7)
    for _ in range(200):
        text = "".join(rng.choice(TEXTS) for _ in range(2))
        ids = tokenizer.encode(text)
        full = full_decode(tokenizer, ids)
        start = rng.randrange(len(full))
        stop = full[start:start + rng.randrange(1, 6)]
        pieces, detok = incremental(tokenizer, ids, [rng.randrange(1, 4)], stop=[stop])
        assert "".join(pieces) == full[:full.index(stop)]
        assert detok.stopped


def test_empty_stop_string_is_rejected(tokenizer):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tokenizer, [""])


# ---------------------------------------------------------------- which decode the windows take


def _counting_decode(monkeypatch, tokenizer) -> list[int]:
    """Counts the calls of ``tokenizer.decode`` (transformers' own) from here on."""
    calls = []
    original = tokenizer.decode

    def decode(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", decode)
    return calls


def test_smollm2s_windows_are_decoded_by_the_rust_tokenizer_with_the_same_text(tokenizer, monkeypatch):
    rng = random.Random(5)
    samples = [[rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))] + [0, 2] for _ in range(300)]
    samples += [tokenizer.encode(text) for text in TEXTS]
    expected = [full_decode(tokenizer, ids) for ids in samples]
    calls = _counting_decode(monkeypatch, tokenizer)
    decode = window_decoder(tokenizer)
    assert [decode(ids) for ids in samples] == expected
    pieces, _ = incremental(tokenizer, tokenizer.encode(TEXTS[1]), [1])
    assert "".join(pieces) == expected[len(samples) - len(TEXTS) + 1]
    assert calls == []  # transformers' decode never ran


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(tokenizer, monkeypatch):
    ids = tokenizer.encode("Hello , world ! It 's here .")
    calls = _counting_decode(monkeypatch, tokenizer)
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert window_decoder(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(calls) == 2


def test_a_tokenizer_class_with_its_own_decode_keeps_it(tokenizer, monkeypatch):
    ids = tokenizer.encode("Hello , world ! It 's here .")

    class Shouting(type(tokenizer)):
        def decode(self, token_ids, **kwargs):
            return super().decode(token_ids, **kwargs).upper()

    monkeypatch.setattr(tokenizer, "__class__", Shouting)
    assert window_decoder(tokenizer)(ids) == "HELLO , WORLD ! IT 'S HERE ."
