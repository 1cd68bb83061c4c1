"""``LLM(**kwargs)``: each keyword goes to the options object that takes it; unknown ones are refused."""

from __future__ import annotations

import dataclasses

import pytest

from services.executor.loader import RunnerOptions
from services.offline_options import SchedulingOptions, split_options
from shared.engine_flags import RunnerFlags, SchedulingFlags


def test_each_keyword_lands_in_its_options():
    runner, scheduling = split_options({"block_size": 8, "num_kv_blocks": 12, "kv_cache_memory": "2MiB",
                                        "dtype": "float32", "max_model_len": 99, "seed": 5, "num_cpu_blocks": 3,
                                        "max_num_seqs": 3, "max_num_batched_tokens": 40, "preemption_mode": "swap",
                                        "kv_policy": "contiguous", "enable_prefix_caching": False,
                                        "async_scheduling": True})
    assert (runner.block_size, runner.num_kv_blocks, runner.kv_cache_memory, runner.dtype, runner.max_model_len,
            runner.seed, runner.num_cpu_blocks) == (8, 12, "2MiB", "float32", 99, 5, 3)
    assert scheduling == SchedulingOptions(3, 40, "swap", "contiguous", False, True)


def test_every_option_of_either_object_is_a_keyword_and_the_defaults_are_the_flags():
    runner, scheduling = split_options({})
    assert runner.device == RunnerFlags().device == "auto"  # as vLLM's LLM: a GPU where there is one
    assert runner == RunnerOptions(device="auto") and scheduling == SchedulingOptions()
    assert scheduling.async_scheduling is False  # LLM's own: one process, nothing to overlap
    flags = dataclasses.asdict(SchedulingFlags())
    for f in dataclasses.fields(SchedulingOptions):
        if f.name != "async_scheduling":
            assert getattr(scheduling, f.name) == flags[f.name], f.name
    for cls in (RunnerOptions, SchedulingOptions):
        for f in dataclasses.fields(cls):
            value = getattr(split_options({f.name: getattr(cls(), f.name)})[cls is SchedulingOptions], f.name)
            assert value == getattr(cls(), f.name), f.name


def test_unknown_keywords_are_refused_by_name():
    with pytest.raises(TypeError, match=r"unknown options \['num_gpus', 'tp'\]; it takes \[.*'block_size'"):
        split_options({"num_gpus": 2, "tp": 2, "block_size": 8})
    with pytest.raises(ValueError, match="--block-size"):  # a known one is checked as the flag is
        split_options({"block_size": 3})
