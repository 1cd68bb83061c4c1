"""``--reasoning-parser``: a reasoning model's thinking apart from its answer (no I/O here).

The ``<think>...</think>`` family, as vLLM's parsers of the same names read it:

- ``deepseek_r1``: DeepSeek-R1's chat template opens ``<think>`` in the prompt, so the output starts
  inside the reasoning whether or not it repeats the tag (R1-0528 does). The reasoning ends at
  ``</think>``; after it comes the content. An output without ``</think>`` is all reasoning.
- ``qwen3``: Qwen3 writes ``<think>`` itself; with ``enable_thinking: false`` its template closes an
  empty block in the prompt and the output has none. An output that does not open with ``<think>`` is
  all content, unless the prompt itself ends inside an open ``<think>`` (the Qwen3 *-Thinking-2507
  templates): then it starts in the reasoning, as with ``deepseek_r1``.

An opening tag counts at the start of the output (after whitespace, which is dropped with it) and
only there; the first ``</think>`` after it ends the reasoning, later tags are content as they
stand. A block the output opens and never closes (cut by ``max_tokens``) is reasoning: the stream
has sent it as such and cannot take it back (vLLM's whole response calls it content under qwen3;
here the stream and the whole response agree). Empty parts are ``None``.

``Reasoning.split`` reads a whole output; ``StreamSplitter`` reads it delta by delta and gives the
same parts in pieces, holding back text that could be the start of a tag (``<thi``) until the next
delta or the end (``finish``).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.frontend.partial_marks import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class Reasoning:
    """One output's parser: ``starts_inside`` when the output begins in the reasoning without a tag."""

    starts_inside: bool

    def split(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output."""
        rest = text.lstrip()
        if rest.startswith(OPEN):
            body = rest[len(OPEN):]
        elif self.starts_inside:
            body = text
        else:
            return None, text or None
        reasoning, _, content = body.partition(CLOSE)
        return reasoning or None, content or None

    def streamer(self) -> "StreamSplitter":
        return StreamSplitter(self.starts_inside)


def reasoning_for(parser: str | None, prompt_tail: str = "") -> Reasoning | None:
    """The parser ``--reasoning-parser`` names for an output whose prompt ends with ``prompt_tail``
    (its last few tokens' text, special tokens kept); None without a parser."""
    if parser is None:
        return None
    if parser == "deepseek_r1":
        return Reasoning(starts_inside=True)
    if parser == "qwen3":
        return Reasoning(starts_inside=prompt_opens_reasoning(prompt_tail))
    raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {parser!r}")


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt ends inside a ``<think>`` block it opened (and did not close)."""
    return prompt_tail.rstrip().endswith(OPEN)


_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class StreamSplitter:
    """Text deltas in, ``(reasoning, content)`` pieces out (``""`` where a delta gave none); the
    pieces of each side joined equal ``Reasoning.split`` of the whole text (``""`` for ``None``)."""

    def __init__(self, starts_inside: bool) -> None:
        self._starts_inside = starts_inside
        self._state = _START
        self._held = ""  # text not yet given out: maybe the start of a tag

    def feed(self, delta: str) -> tuple[str, str]:
        self._held += delta
        reasoning, content = "", ""
        while True:
            if self._state == _START:
                rest = self._held.lstrip()
                if rest.startswith(OPEN):
                    self._held, self._state = rest[len(OPEN):], _REASONING
                elif OPEN.startswith(rest):
                    return reasoning, content  # whitespace, or a tag begun: wait for more
                else:
                    self._state = _REASONING if self._starts_inside else _CONTENT
            elif self._state == _REASONING:
                end = self._held.find(CLOSE)
                if end < 0:
                    keep = partial_suffix(self._held, CLOSE)
                    reasoning += self._held[:len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep:]
                    return reasoning, content
                reasoning += self._held[:end]
                self._held, self._state = self._held[end + len(CLOSE):], _CONTENT
            else:
                content, self._held = content + self._held, ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held at the end: a tag begun and never finished is text as it stands."""
        held, self._held = self._held, ""
        if self._state == _START:
            self._state = _REASONING if self._starts_inside else _CONTENT
        return (held, "") if self._state == _REASONING else ("", held)
