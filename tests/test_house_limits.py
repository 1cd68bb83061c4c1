"""The house's size limits (issue 45): no file under ``services/`` over 300 lines, and no function or
method in ``services/`` or ``shared/`` over 60 lines (``kernels`` excepted: a kernel is one function
on purpose). Each offender is named as ``path:line name (N lines)``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 60


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def long_files(max_lines: int = MAX_FILE_LINES) -> list[str]:
    """``path (N lines)`` for each file under ``services/`` longer than ``max_lines``."""
    offenders = []
    for path in _sources("services"):
        num_lines = len(path.read_text().splitlines())
        if num_lines > max_lines:
            offenders.append(f"{path.relative_to(ROOT)} ({num_lines} lines)")
    return offenders


def long_functions(max_lines: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` for each function or method (nested ones too) in ``services/`` or
    ``shared/``, outside any ``kernels`` folder, longer than ``max_lines`` (``def`` line to last line)."""
    offenders = []
    for path in _sources("services", "shared"):
        relative = path.relative_to(ROOT)
        if "kernels" in relative.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(relative))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                num_lines = node.end_lineno - node.lineno + 1
                if num_lines > max_lines:
                    offenders.append(f"{relative}:{node.lineno} {node.name} ({num_lines} lines)")
    return offenders


def test_no_file_in_services_is_over_300_lines():
    offenders = long_files()
    assert not offenders, "files over 300 lines:\n" + "\n".join(offenders)


def test_no_function_outside_kernels_is_over_60_lines():
    offenders = long_functions()
    assert not offenders, "functions over 60 lines:\n" + "\n".join(offenders)


def test_the_checks_see_the_sources_and_name_what_is_over():
    assert len(_sources("services")) > 50 and len(_sources("shared")) > 10
    assert long_files(0) and all(line.endswith(" lines)") for line in long_files(0))
    assert any(line.startswith("services/frontend/engine_client.py:") for line in long_functions(1))  # methods
