"""``services/frontend/reasoning.py``: the ``<think>`` family's parsers on outputs in each model's
format, whole and streamed (split at every character boundary, and character by character, the
pieces joined equal the whole output's parts)."""

from __future__ import annotations

import pytest

from services.frontend.reasoning import Reasoning, prompt_opens_reasoning, reasoning_for

R1 = reasoning_for("deepseek_r1")
QWEN3 = reasoning_for("qwen3")
QWEN3_THINKING = reasoning_for("qwen3", "<|im_start|>assistant\n<think>\n")  # the 2507 Thinking templates

CASES = [  # parser, output, (reasoning, content)
    # DeepSeek-R1: the prompt opened <think>; R1-0528 repeats it
    (R1, "The user wants 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     ("The user wants 2+2. That is 4.\n", "\n\nThe answer is 4.")),
    (R1, "<think>\nLet me think.\n</think>\n\n4", ("\nLet me think.\n", "\n\n4")),
    (R1, "\n<think>a</think>b", ("a", "b")),
    (R1, "still thinking, cut by max_tokens", ("still thinking, cut by max_tokens", None)),
    (R1, "</think>Only an answer.", (None, "Only an answer.")),
    (R1, "thought</think>", ("thought", None)),
    (R1, "a</think>b</think>c<think>d", ("a", "b</think>c<think>d")),
    (R1, "東京 🚀 </thin", ("東京 🚀 </thin", None)),
    (R1, "<thi", ("<thi", None)),
    (R1, "", (None, None)),
    # Qwen3 writes <think> itself; with enable_thinking false there is no block
    (QWEN3, "<think>\nOkay, 2+2 is 4.\n</think>\n\n2+2 = 4.", ("\nOkay, 2+2 is 4.\n", "\n\n2+2 = 4.")),
    (QWEN3, "2+2 = 4.", (None, "2+2 = 4.")),
    (QWEN3, "Plain answer with a stray </think> inside", (None, "Plain answer with a stray </think> inside")),
    (QWEN3, "  <think>x</think>y", ("x", "y")),
    (QWEN3, "Answer: <think>not a block</think>", (None, "Answer: <think>not a block</think>")),
    (QWEN3, "<think>cut short by max_tok", ("cut short by max_tok", None)),
    (QWEN3, "<think></think>Hi", (None, "Hi")),
    (QWEN3, "<thin", (None, "<thin")),
    (QWEN3, "\n\n", (None, "\n\n")),
    (QWEN3, "<3 <thinking>", (None, "<3 <thinking>")),
    (QWEN3_THINKING, "reasoning here\n</think>\n\ncontent", ("reasoning here\n", "\n\ncontent")),
    (QWEN3_THINKING, "no end yet", ("no end yet", None)),
]


@pytest.mark.parametrize("parser, text, parts", CASES)
def test_split(parser, text, parts):
    assert parser.split(text) == parts


def streamed(parser: Reasoning, deltas: list[str]) -> tuple[str | None, str | None]:
    splitter = parser.streamer()
    reasoning, content = "", ""
    for delta in deltas:
        r, c = splitter.feed(delta)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r or None, content + c or None


@pytest.mark.parametrize("parser, text, parts", CASES)
def test_streamed_at_every_boundary_equals_the_whole(parser, text, parts):
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]]) == parts, cut
        for cut2 in range(cut, len(text) + 1):
            assert streamed(parser, [text[:cut], text[cut:cut2], text[cut2:]]) == parts, (cut, cut2)
    assert streamed(parser, list(text)) == parts
    assert streamed(parser, [text]) == parts


def test_a_partial_tag_is_held_until_it_is_known():
    splitter = R1.streamer()
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("nk>abc</th") == ("abc", "")
    assert splitter.feed("ink>an") == ("", "an")
    assert splitter.feed("swer") == ("", "swer")
    assert splitter.finish() == ("", "")
    splitter = QWEN3.streamer()
    assert splitter.feed(" ") == ("", "")
    assert splitter.feed("<tho") == ("", " <tho")  # not a tag: the held text is content
    splitter = R1.streamer()
    assert splitter.feed("x </") == ("x ", "")
    assert splitter.finish() == ("</", "")


def test_the_prompt_decides_where_qwen3_starts():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking false
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert reasoning_for("deepseek_r1", "<|im_start|>assistant\n") == Reasoning(True)  # R1: always inside
    assert reasoning_for(None) is None
    with pytest.raises(ValueError, match="--reasoning-parser must be one of deepseek_r1, qwen3"):
        reasoning_for("granite")
