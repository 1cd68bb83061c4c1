"""The declaration machinery on a class of its own: each kind of flag, parsed and put back on a
command line that parses to the same values."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import pytest

from shared.flag_spec import add_flags, declared, from_args, given, help_text, to_argv, flag


@dataclass(frozen=True, kw_only=True)
class Toy:
    TITLE: ClassVar[str] = "toy"

    size: int = flag(16, "a number")
    rate: float = flag(0.5, "a fraction", metavar="F")
    name: str | None = flag(None, "a name", shown="the model's")
    mode: str = flag("a", "a choice", choices=("a", "b"))
    fast: bool = flag(True, "a switch")
    cache: bool = flag(True, "an on/off pair", names=("--enable-cache",), off=("--no-cache",))
    page: bool = flag(True, "an off switch", off=("--no-page",), eager=True)
    parallel: int = flag(1, "an alias", names=("-p", "--parallel-size"), eager=True)
    secret: str | None = flag(None, "a secret", on_argv=False)
    limit: int = flag(7, "another dest", dest="toy_limit")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_flags(parser, Toy)
    return parser


def test_nothing_given_parses_to_the_declared_defaults():
    args = _parser().parse_args([])
    assert from_args(args, Toy) == Toy()
    assert given(args, Toy) == {"page": True, "parallel": 1}  # only the eager flags hold a value
    assert to_argv(args, Toy) == ["--parallel-size", "1"]  # an eager switch at its default needs no flag


def test_each_kind_round_trips_through_a_childs_command_line():
    argv = ["--size", "32", "--rate", "0.25", "--name", "m", "--mode", "b", "--no-fast", "--no-cache", "--no-page",
            "-p", "4", "--secret", "s", "--toy-limit", "9"]
    args = _parser().parse_args(argv)
    config = from_args(args, Toy)
    assert config == Toy(size=32, rate=0.25, name="m", mode="b", fast=False, cache=False, page=False, parallel=4,
                         secret="s", limit=9)
    child = to_argv(args, Toy)
    assert "--secret" not in child and "s" not in child  # never on a command line
    assert from_args(_parser().parse_args(child), Toy) == Toy(**{**config.__dict__, "secret": None})
    on = _parser().parse_args(["--fast", "--enable-cache"])
    assert [a for a in to_argv(on, Toy) if "fast" in a or "cache" in a] == ["--fast", "--enable-cache"]


def test_help_says_the_default_once_and_choices_are_enforced():
    fields = dict((f.name, (f, s)) for f, s in declared(Toy))
    assert help_text(*fields["size"]) == "a number (default 16)"
    assert help_text(*fields["name"]) == "a name (default the model's)"
    assert help_text(*fields["secret"]) == "a secret"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--mode", "c"])
    with pytest.raises(KeyError, match="declares no flag"):
        declared(Toy, ("nope",))
