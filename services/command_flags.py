"""Which declared flags each command takes, in one table that the parsers (``services.cli``) and
the launcher's child command lines (``services.launcher``) are both derived from, so that what
``serve`` passes a child is what the child's parser reads.

An entry is ``(declaring class, field names or None for all of them)``. ``CHILD_FLAGS[c]`` are the
flags of command ``c`` that serve passes on from its own command line, when given (the frontend's
are declared beside it); ``GROUP_FLAGS[c]`` those the launcher sets itself for the executor group
(``group_layout``). ``SERVE_FLAGS``: all that ``serve`` takes. ``scheduler_argv``, ``rank_argv``
and ``frontend_argv``: the command lines serve starts its children with.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from services.frontend.flags import FRONTEND_FLAGS, HttpFlags, HttpLimits
from shared.engine_flags import (
    LivenessFlags, ModelFlags, ParallelFlags, RankFlags, ReplicaFlags, RunnerFlags, SchedulingFlags,
    SupervisorFlags,
)
from shared.flag_spec import add_flags, given, to_argv

if TYPE_CHECKING:
    from services.data_parallel import ReplicaPlan

Flags = tuple[tuple[type, tuple[str, ...] | None], ...]

CHILD_FLAGS: dict[str, Flags] = {
    "scheduler": ((ModelFlags, ("max_model_len",)), (SchedulingFlags, None), (LivenessFlags, None)),
    "executor": ((ModelFlags, None), (RunnerFlags, None)),
    "frontend": FRONTEND_FLAGS,
}
GROUP_FLAGS: dict[str, Flags] = {
    "scheduler": ((RankFlags, ("world_size",)), (ReplicaFlags, None)),
    "executor": ((RankFlags, None),
                 (ParallelFlags, ("all_reduce", "dist_init_addr", "num_nodes", "group_timeout_s"))),
}
SERVE_FLAGS: Flags = ((ModelFlags, None), (RunnerFlags, None), (ParallelFlags, None), (SchedulingFlags, None),
                      (LivenessFlags, None), (SupervisorFlags, None), (HttpFlags, None), (HttpLimits, None))


def add_command_flags(parser: argparse.ArgumentParser, flags: Flags) -> None:
    """Add ``flags`` to ``parser``, one argument group per declaring class."""
    for cls, only in flags:
        add_flags(parser.add_argument_group(cls.TITLE), cls, only)


def child_argv(args: argparse.Namespace, command: str) -> list[str]:
    """The flags serve passes the ``command`` child: those of ``CHILD_FLAGS[command]`` it was given."""
    return [arg for cls, only in CHILD_FLAGS[command] for arg in to_argv(args, cls, only)]


def given_values(args: argparse.Namespace, flags: Flags) -> dict:
    """The values given (not None) of ``flags``, by field name: a child's config keywords."""
    values: dict = {}
    for cls, only in flags:
        values.update(given(args, cls, only))
    return values


# The command line each child of ``serve`` gets (``services.launcher``), from serve's parsed flags.

def scheduler_argv(args: argparse.Namespace) -> list[str]:
    return child_argv(args, "scheduler")


def executor_argv(args: argparse.Namespace) -> list[str]:
    return child_argv(args, "executor")


def rank_argv(plan: "ReplicaPlan", rank: int) -> list[str]:
    """Executor rank ``rank``'s flags: serve's, its group's, and its GPU's place where not its rank."""
    index = plan.device_index(rank)
    return (executor_argv(plan.args) + plan.layout.executor_argv(rank, plan.args.num_threads)
            + ([] if index == rank else ["--device-index", str(index)]))


def frontend_argv(args: argparse.Namespace) -> list[str]:
    return child_argv(args, "frontend")


def frontend_env(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """The API key goes to the frontend in its environment: an argv is readable by every user."""
    return {**env, "PAGEDSERVE_API_KEY": args.api_key} if args.api_key else env
