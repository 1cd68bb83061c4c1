"""``docs/flags.md`` is what ``python -m services.flags_doc`` writes, and names every flag of
every command once, with its default."""

from __future__ import annotations

import re

from services.cli import build_parser
from services.flags_doc import DOC_PATH, SERVICE_COMMANDS, TOOL_COMMANDS, documented_default, render, subcommands


def _rows(text: str) -> dict[str, list[tuple[str, str]]]:
    """Section title -> (flag cell, default cell) of each table row."""
    out: dict[str, list[tuple[str, str]]] = {}
    title = ""
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:]
        elif (m := re.match(r"\| `([^`]+)` \| ([^|]*) \|", line)) and title:
            out.setdefault(title, []).append((m.group(1), m.group(2).strip()))
    return out


def test_docs_flags_md_is_not_stale():
    assert DOC_PATH.read_text() == render(build_parser()), "docs/flags.md is stale: run python -m services.flags_doc"


def test_every_option_appears_once_with_its_default():
    rows = _rows(DOC_PATH.read_text())
    engine = [row for title, section in rows.items() if not title.startswith("pagedserve ") for row in section]
    commands = subcommands(build_parser())
    for name in SERVICE_COMMANDS + TOOL_COMMANDS:
        table = engine if name in SERVICE_COMMANDS else rows[f"pagedserve {name}"]
        for action in commands[name]._actions:
            for option in action.option_strings or [action.dest]:
                if option in ("-h", "--help"):
                    continue
                found = [(cell, default) for cell, default in table if option in cell.split(", ")]
                assert len(found) == 1, (name, option, found)
                assert found[0][1] == documented_default(action).replace("<", "&lt;"), (name, option)
    assert ("--max-num-batched-tokens", "2048") in engine and ("--port", "8000") in engine
    assert ("-tp, --tensor-parallel-size", "1") in engine and ("--block-size", "16") in engine
