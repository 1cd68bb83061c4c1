"""Where a stream must hold text back: the end of the text so far that may be the start of a mark
(a tag such as ``</think>``, a tool-call marker) whose rest has not come yet."""

from __future__ import annotations


def partial_suffix(text: str, mark: str) -> int:
    """The length of the longest end of ``text`` that begins ``mark`` (shorter than the mark)."""
    for size in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-size:]):
            return size
    return 0
