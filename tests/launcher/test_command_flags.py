"""Flags declared once: every declared field is a flag of the commands that take it, parsing
nothing gives the declared defaults, what serve passes each child parses there to the same
values, and the processes' configs default to the declarations."""

from __future__ import annotations

import dataclasses

import pytest

from services.cli import build_parser
from services.command_flags import CHILD_FLAGS, GROUP_FLAGS, SERVE_FLAGS, child_argv, given_values
from services.executor.loader import RunnerOptions
from services.executor.main import ExecutorConfig
from services.executor.parallel.group import GroupConfig
from services.frontend.config import FrontendConfig
from services.frontend.flags import HttpFlags
from services.offline_options import SchedulingOptions
from services.scheduler.main import SchedulerProcessConfig
from shared.engine_flags import LivenessFlags, ParallelFlags, RankFlags, RunnerFlags, SchedulingFlags
from shared.flag_spec import declared, from_args, option_strings, to_argv

# Values unlike the defaults that the children's configs accept, where a made-up one would not do
_VALUES = {"block_size": "32", "kv_cache_memory": "64MiB", "dtype": "float32", "device": "cpu",
           "generation_config": "vllm", "linear_kernel": "torch", "plan_ahead_at": "0.5",
           "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}',
           "kv_events_config": '{"enable_kv_cache_events": true, "topic": "kv-events"}'}


def _non_default_argv(flags) -> list[str]:
    """A command line giving every flag of ``flags`` a value other than its default."""
    argv: list[str] = []
    for cls, only in flags:
        for f, spec in declared(cls, only):
            if not spec.on_argv:
                continue
            names = option_strings(f, spec)
            if isinstance(f.default, bool):
                argv.append(next(iter(spec.off)) if f.default and spec.off else
                            "--no-" + names[-1][2:] if f.default else names[-1])
            elif spec.choices and f.name not in _VALUES:
                argv += [names[-1], next(c for c in spec.choices if c != f.default)]
            else:
                kind = spec.type or (type(f.default) if f.default is not None else str)
                value = _VALUES.get(f.name) or {int: "3", float: "2.5", str: f"x-{f.name}"}[kind]
                argv += [names[-1], value]
    return argv


def test_every_declared_flag_is_in_the_parsers_and_nothing_given_is_the_declared_defaults():
    commands = {"serve": SERVE_FLAGS, **{c: CHILD_FLAGS[c] + GROUP_FLAGS.get(c, ()) for c in CHILD_FLAGS}}
    parser = build_parser()
    for command, flags in commands.items():
        argv = [command] + (["--request-endpoint", "ipc:///tmp/x"] if command == "frontend" else [])
        options = {o for a in parser._subparsers._group_actions[0].choices[command]._actions for o in a.option_strings}
        args = parser.parse_args(argv)
        for cls, only in flags:
            for f, spec in declared(cls, only):
                assert set(option_strings(f, spec) + spec.off) <= options, (command, f.name)
            if only is None:
                assert from_args(args, cls) == cls(), (command, cls.__name__)
            defaults = cls()
            for name, value in given_values(args, ((cls, only),)).items():  # only the eager flags hold one
                assert value == getattr(defaults, name), (command, name)


@pytest.mark.parametrize("child", sorted(CHILD_FLAGS))
def test_what_serve_passes_a_child_parses_there_to_the_same_values(child):
    parser = build_parser()
    serve = parser.parse_args(["serve", *_non_default_argv(CHILD_FLAGS[child])])
    argv = child_argv(serve, child)
    extra = ["--request-endpoint", "ipc:///tmp/x"] if child == "frontend" else []
    parsed = parser.parse_args([child, *argv, *extra])
    for cls, only in CHILD_FLAGS[child]:
        sent = {f.name for f, spec in declared(cls, only) if spec.on_argv}
        want = {k: v for k, v in given_values(serve, ((cls, only),)).items() if k in sent}
        assert len(want) == len(sent), f"the test gives every flag of {cls.__name__}"
        assert {k: v for k, v in given_values(parsed, ((cls, only),)).items() if k in sent} == want
        assert to_argv(parsed, cls, only) == to_argv(serve, cls, only)


def test_the_scheduler_and_frontend_configs_take_the_non_default_values():
    parser = build_parser()
    serve = parser.parse_args(["serve", *_non_default_argv(CHILD_FLAGS["scheduler"])])
    args = parser.parse_args(["scheduler", *child_argv(serve, "scheduler")])
    from shared.endpoints import Endpoints

    config = SchedulerProcessConfig(endpoints=Endpoints("ipc://a", "ipc://b", "ipc://c"),
                                    **given_values(args, CHILD_FLAGS["scheduler"] + GROUP_FLAGS["scheduler"]))
    for name, value in given_values(serve, CHILD_FLAGS["scheduler"]).items():
        assert getattr(config, name) == value != getattr(SchedulerProcessConfig, name, None), name
    assert config.async_scheduling is False and config.enable_prefix_caching is False


def test_the_processes_configs_default_to_the_declarations():
    pairs = [(SchedulerProcessConfig, (SchedulingFlags, LivenessFlags)), (ExecutorConfig, (RunnerFlags, RankFlags)),
             (FrontendConfig, (HttpFlags, LivenessFlags)), (GroupConfig, (RankFlags,)),
             (SchedulingOptions, (SchedulingFlags,)), (RunnerOptions, (RunnerFlags,))]
    own = {(SchedulingOptions, "async_scheduling"): False, (RunnerOptions, "device"): "cpu"}  # said in their docs
    checked = 0
    for config, groups in pairs:
        defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
        for cls in groups:
            for name, value in dataclasses.asdict(cls()).items():
                if name in defaults:
                    assert defaults[name] == own.get((config, name), value), (config.__name__, name)
                    checked += 1
    assert ExecutorConfig.__dataclass_fields__["group_timeout_s"].default == ParallelFlags().group_timeout_s
    assert checked > 30
