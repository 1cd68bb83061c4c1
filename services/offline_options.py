"""``LLM(**kwargs)``'s options: each keyword is a flag of the same name (``shared.engine_flags``)
and goes to the options object of the part that takes it: ``RunnerOptions`` (the model runner and
its KV pools, as the executor's flags) or ``SchedulingOptions`` (as the scheduler's). A keyword
neither takes is refused with a ``TypeError`` naming it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from services.executor.loader import RunnerOptions
from shared.engine_flags import RunnerFlags, SchedulingFlags

_SCHEDULING = SchedulingFlags()  # the flags' defaults, declared there once


@dataclass(frozen=True)
class SchedulingOptions:
    """The scheduler's flags of the same names (``--max-num-seqs`` and so on)."""

    max_num_seqs: int = _SCHEDULING.max_num_seqs
    max_num_batched_tokens: int = _SCHEDULING.max_num_batched_tokens
    preemption_mode: str = _SCHEDULING.preemption_mode
    kv_policy: str = _SCHEDULING.kv_policy
    enable_prefix_caching: bool = _SCHEDULING.enable_prefix_caching
    async_scheduling: bool = False  # unlike the server, lock-step unless asked: one process, nothing to overlap
    speculative_config: str | None = None  # JSON, as the flag (``shared.speculative``)


# Which options object takes each keyword; LLM's defaults where they are not the classes' own
LLM_OPTIONS: tuple[type, ...] = (RunnerOptions, SchedulingOptions)
LLM_DEFAULTS = {"device": RunnerFlags().device}  # as vLLM's LLM: the GPU where there is one


def option_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def split_options(engine_kwargs: dict[str, Any]) -> tuple[RunnerOptions, SchedulingOptions]:
    """``LLM``'s keywords as (``RunnerOptions``, ``SchedulingOptions``); ``TypeError`` for an unknown one."""
    engine_kwargs = {**LLM_DEFAULTS, **engine_kwargs}
    known = set().union(*(option_names(cls) for cls in LLM_OPTIONS))
    unknown = set(engine_kwargs) - known
    if unknown:
        raise TypeError(f"LLM got unknown options {sorted(unknown)}; it takes {sorted(known)}")
    runner, scheduling = (cls(**{k: v for k, v in engine_kwargs.items() if k in option_names(cls)})
                          for cls in LLM_OPTIONS)
    return runner, scheduling
