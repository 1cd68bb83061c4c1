"""Flags declared once: a frozen config dataclass whose fields carry their command-line flag.

    @dataclass(frozen=True, kw_only=True)
    class SchedulingFlags:
        TITLE: ClassVar[str] = "scheduling"
        max_num_seqs: int = flag(64, "sequences per step")

From such a class come the argparse options (``add_flags``), what a parsed command line gave
(``given``: the fields not left at ``None``), the class itself filled from it (``from_args``), the
argv that hands the same values to a child process (``to_argv``) and the rows of ``docs/flags.md``
(``doc_default``, ``help_text``). A field's argparse ``dest`` is its name unless declared.

The parser's default is ``None`` ("not given"), so that a launcher passes on only what the user
gave and every process falls back on the one default, the field's; ``eager`` flags (``--host``,
``-tp``...) take the field's default in the parser, as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

_KEY = "pagedserve_flag"


@dataclass(frozen=True)
class FlagSpec:
    help: str
    names: tuple[str, ...] = ()  # option strings; () and no ``off``: --field-name
    off: tuple[str, ...] = ()  # a bool field's store_false option strings (``names`` then store_true)
    type: Any = None  # argparse's type; None: the default's type (str for None)
    choices: tuple | None = None
    metavar: str | None = None
    shown: str | None = None  # the default as help and docs say it, where not the value itself
    eager: bool = False  # the parser's default is the field's (else None: not given)
    on_argv: bool = True  # False: a secret, never put on a child's command line
    dest: str | None = None  # argparse's dest, where not the field's name


def flag(default: Any, help: str, *, names: Iterable[str] = (), off: Iterable[str] = (), type: Any = None,
         choices: Iterable | None = None, metavar: str | None = None, shown: str | None = None,
         eager: bool = False, on_argv: bool = True, dest: str | None = None) -> Any:
    """A dataclass field with ``default`` that is also a command-line flag."""
    spec = FlagSpec(help, tuple(names), tuple(off), type, tuple(choices) if choices else None, metavar, shown,
                    eager, on_argv, dest)
    return field(default=default, metadata={_KEY: spec})


def declared(cls: type, only: Iterable[str] | None = None) -> list[tuple[dataclasses.Field, FlagSpec]]:
    """``cls``' flag fields in declaration order (those named in ``only``, when given)."""
    chosen = None if only is None else set(only)
    fields = [(f, f.metadata[_KEY]) for f in dataclasses.fields(cls) if _KEY in f.metadata]
    if chosen is not None:
        unknown = chosen - {f.name for f, _ in fields}
        if unknown:
            raise KeyError(f"{cls.__name__} declares no flag {sorted(unknown)}")
        fields = [(f, s) for f, s in fields if f.name in chosen]
    return fields


def dest(f: dataclasses.Field, spec: FlagSpec) -> str:
    return spec.dest or f.name


def option_strings(f: dataclasses.Field, spec: FlagSpec) -> tuple[str, ...]:
    if spec.names or spec.off:
        return spec.names
    return ("--" + dest(f, spec).replace("_", "-"),)


def doc_default(f: dataclasses.Field, spec: FlagSpec) -> str:
    """The default as help and docs show it ("" where there is none worth saying)."""
    if spec.shown is not None:
        return spec.shown
    if f.default is None:
        return ""
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return str(f.default)


def help_text(f: dataclasses.Field, spec: FlagSpec) -> str:
    default = doc_default(f, spec)
    return f"{spec.help} (default {default})" if default else spec.help


def add_flags(container: argparse._ActionsContainer, cls: type, only: Iterable[str] | None = None) -> None:
    """Add ``cls``' flags (or those in ``only``) to a parser or argument group. Each action keeps
    its declaration (``flag_class``, ``flag_default``, ``flag_help``) for ``docs/flags.md``."""
    for f, spec in declared(cls, only):
        parser_default = f.default if spec.eager else None
        common = {"dest": dest(f, spec), "default": parser_default, "help": help_text(f, spec)}
        if isinstance(f.default, bool):
            actions = []
            if spec.off:
                actions.append(container.add_argument(*spec.off, action="store_false", **common))
                if spec.names:
                    actions.append(container.add_argument(*spec.names, action="store_true", **common))
            else:
                actions.append(container.add_argument(*option_strings(f, spec),
                                                      action=argparse.BooleanOptionalAction, **common))
        else:
            kind = spec.type or (type(f.default) if f.default is not None else str)
            actions = [container.add_argument(*option_strings(f, spec), type=kind, choices=spec.choices,
                                              metavar=spec.metavar, **common)]
        for action in actions:
            action.flag_class, action.flag_default, action.flag_help = cls, doc_default(f, spec), spec.help


def given(args: argparse.Namespace, cls: type, only: Iterable[str] | None = None) -> dict[str, Any]:
    """The values of ``cls``' flags that ``args`` holds and are not None (not given)."""
    values = {f.name: getattr(args, dest(f, spec), None) for f, spec in declared(cls, only)}
    return {name: value for name, value in values.items() if value is not None}


def from_args(args: argparse.Namespace, cls: type, **extra: Any):
    """``cls`` from parsed flags: what was given, the fields' defaults for the rest."""
    return cls(**given(args, cls), **extra)


def to_argv(args: argparse.Namespace, cls: type, only: Iterable[str] | None = None) -> list[str]:
    """The command line that gives a child's parser the same values of ``cls``' flags as ``args``:
    only those given (not None), a switch as its on or off option, never a secret."""
    argv: list[str] = []
    for f, spec in declared(cls, only):
        value = getattr(args, dest(f, spec), None)
        if value is None or not spec.on_argv:
            continue
        names = option_strings(f, spec)
        if isinstance(value, bool):
            if value and names:
                argv.append(_long(names))
            elif not value:
                argv.append(_long(spec.off) if spec.off else "--no-" + _long(names)[2:])
        else:
            argv += [_long(names), str(value)]
    return argv


def _long(names: tuple[str, ...]) -> str:
    return next((n for n in names if n.startswith("--")), names[0])


def defaults(cls: type) -> Any:
    """``cls`` with every field at its default: the one place other configs read them from."""
    return cls()


def json_object(text: str, flag: str) -> dict[str, Any]:
    """A flag's value that must be a JSON object (``--speculative-config``, ``--kv-events-config``);
    ``ValueError`` naming ``flag`` otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value
