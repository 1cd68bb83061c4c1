"""The README's code blocks, read from the README itself, so that the tests that run them run what
a reader copies."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def readme_block(lang: str, containing: str) -> str:
    """The one ``lang`` block of the README whose text contains ``containing``."""
    found = [body for kind, body in FENCE.findall(README.read_text()) if kind == lang and containing in body]
    assert len(found) == 1, f"{len(found)} README {lang} blocks contain {containing!r}"
    return found[0]


def curl_request(block: str) -> tuple[str, dict[str, str], bytes]:
    """A README ``curl`` command's URL, headers and body (``-H``, ``-d``), as it would send them."""
    words = shlex.split(block.replace("\\\n", " "))
    assert words[0] == "curl", block
    url, headers, body = None, {}, b""
    i = 1
    while i < len(words):
        word = words[i]
        if word == "-H":
            name, value = words[i + 1].split(":", 1)
            headers[name.strip()] = value.strip()
            i += 2
        elif word == "-d":
            body = words[i + 1].encode()
            i += 2
        elif word.startswith("-"):
            i += 1  # -s and the like: how curl prints, not what it sends
        else:
            url = word
            i += 1
    assert url is not None, block
    return url, headers, body
