"""Every wire message survives encode -> decode unchanged; anything else is refused."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from shared.messages import (
    MESSAGE_TYPES, PLACEHOLDER_TOKEN_ID, AbortRequest, AddRequest, DecodeError, EngineStats, ExecutorHealth, ExecutorReady, FrontendHello,
    Heartbeat, Hello, KvEventKind, KvSnapshot, KvWatch, NewSequence, ProcessLost, RequestOutput, RequestOutputs, SamplingParams,
    Shutdown, Step, StepResult, decode, encode,
)

SAMPLING = SamplingParams(n=2, temperature=0.7, top_k=5, seed=2**62, stop_token_ids=[3, 4], logprobs=2,
                          eos_token_ids=[2], best_of=3, early_stopping="never", logit_bias_token_ids=[7],
                          logit_bias_values=[-1.5], prompt_logprobs=1)

EXAMPLES = [
    AddRequest("r1", np.array([5, 6, 7], np.int32), SAMPLING, 1234.5),
    AddRequest("r1.r1.c0", np.array([5, 6], np.int32), SamplingParams(eos_token_ids=[2]), 1.5,
               resumed_token_ids=np.array([9, 10, 11], np.int32)),
    AbortRequest("r1"),
    RequestOutput("r1", 1, [8, 9], "length", num_prompt_tokens=3, num_cached_tokens=2, num_preemptions=1,
                  logprobs=[-0.5, -1.0], top_token_ids=[[8, 1], [9, 1]], top_logprobs=[[-0.5, -2.0], [-1.0, -3.0]],
                  request_finished=True, prompt_logprobs=[-2.0, -0.25], prompt_ranks=[3, 1],
                  prompt_top_token_ids=[[4], [6]], prompt_top_logprobs=[[-0.5], [-0.25]]),
    RequestOutput("r2", 0, [], "error", error="the executor failed: boom", request_finished=True, error_kind="engine"),
    RequestOutputs([RequestOutput("r1", 0, [8], logprobs=[-0.5]), RequestOutput("r2", 1, [], "stop", request_finished=True)]),
    FrontendHello(pid=4321),
    Step(
        step_id=7, num_decodes=1, seq_ids=np.array([3, 4], np.int64), input_token_ids=np.array([9, 5, 6], np.int64),
        positions=np.array([4, 0, 1], np.int64), slot_mapping=np.array([20, 8, 9], np.int64),
        query_start_loc=np.array([0, 1, 3], np.int32), context_lens=np.array([5, 2], np.int32),
        block_tables=np.array([[5, 1], [2, 0]], np.int32), sample_mask=np.array([True, False]),
        new_seqs=[NewSequence(4, "r2", SAMPLING, np.array([5, 6, 7, 8], np.int32), 3)], finished_seq_ids=[1],
        block_copies=np.array([[1, 2]], np.int64), swap_out=np.array([[3, 0]], np.int64),
        swap_in=np.array([[0, 3]], np.int64), num_scored_tokens=np.array([0, 2], np.int32), num_prompt_top_logprobs=1,
        epoch=99,
    ),
    Step(  # async scheduling: decodes fed the placeholders of tokens sampled by the step in flight
        step_id=8, num_decodes=2, seq_ids=np.array([3, 4], np.int64),
        input_token_ids=np.array([PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID], np.int64),
        positions=np.array([5, 2], np.int64), slot_mapping=np.array([21, 10], np.int64),
        query_start_loc=np.array([0, 1, 2], np.int32), context_lens=np.array([6, 3], np.int32),
        block_tables=np.array([[5, 1], [2, 0]], np.int32), sample_mask=np.array([True, True]),
    ),
    StepResult(7, np.array([3], np.int64), np.array([11], np.int64), logprobs=np.array([-0.25], np.float32),
               top_token_ids=np.array([[11, 4]], np.int64), top_logprobs=np.array([[-0.25, -2.5]], np.float32),
               prompt_logprobs=np.array([-1.5, -0.5], np.float32), prompt_ranks=np.array([4, 1], np.int64),
               prompt_top_token_ids=np.array([[2], [6]], np.int64),
               prompt_top_logprobs=np.array([[-0.75], [-0.5]], np.float32)),
    StepResult(8, np.zeros(0, np.int64), np.zeros(0, np.int64), error="boom"),
    ExecutorReady(0, 1, 100, 16, 2048, num_cpu_blocks=8, model="tiny", incarnation=2**62 + 5, pid=77, epoch=99),
    ExecutorReady(1, 3, 300, 16, 2048, num_cpu_blocks=8, all_reduce="shm", kv_cache_bytes=3 * 2**20),
    ExecutorReady(0, 1, 100, 16, 32768, model="mistral", sliding_window=4096),
    Hello(99),
    Hello(100, retired_incarnations=[2**62 + 5, 7]),
    Heartbeat(1, 2**62 + 5, 77),
    Shutdown("bye"),
    ProcessLost("executor", 0, 77, "no heartbeat for 10.2 s"),
    EngineStats(1, 2, 100, 10, 30, 40, True, num_steps=5, sum_slots_used=9, num_swap_outs=1, num_recomputes=2,
                world_size=2, all_reduce="torch", num_kv_blocks_per_rank=[100, 120],
                kv_cache_bytes_per_rank=[2**20, 2**20 + 5]),
    EngineStats(0, 0, 100, 0, 0, 0, False, epoch=2**40, pid=12, num_frontends_lost=1,
                executors=[ExecutorHealth(0, 77, "ok", 0.25, 1), ExecutorHealth(1, 0, "starting", -1.0, 0)]),
    KvWatch(on=True),
    KvSnapshot(
        snapshot_id=3, block_size=4, num_blocks=4, num_cpu_blocks=2, used_block_ids=np.array([0, 2], np.int32),
        used_ref_counts=np.array([2, 1], np.int32), cached_block_ids=np.array([0, 1], np.int32),
        cpu_used_block_ids=np.array([0], np.int32), cpu_used_ref_counts=np.array([1], np.int32),
        seq_ids=np.array([5, 6, 7], np.int64), request_ids=["ra", "ra", "rb"],
        choice_idxs=np.array([0, 1, 0], np.int32),
        on_cpu=np.array([False, False, True]), num_computed_tokens=np.array([5, 6, 3], np.int32),
        table_starts=np.array([0, 2, 3, 4], np.int32), table_block_ids=np.array([0, 2, 0, 0], np.int32),
        events=np.array([[KvEventKind.COPY, 1, 2], [KvEventKind.SWAP_OUT, 3, 0]], np.int32), num_events_dropped=1,
        stats=EngineStats(2, 0, 4, 2, 11, 12, True, num_swapped=1, num_kv_snapshots=3),
    ),
]


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_every_message_type_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    _assert_same(decode(encode(message)), message)


def _by_runtime_type(value):
    """The wire form as the codec first wrote it, from each value's runtime type (arrays as
    [dtype, shape, little-endian bytes], messages as their fields in order, lists item by item):
    the reference the per-class encoders, built from the field hints, must match byte for byte."""
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        little = arr.dtype.newbyteorder("<")
        return [little.str, list(arr.shape), arr.astype(little).tobytes()]
    if dataclasses.is_dataclass(value):
        return [_by_runtime_type(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list):
        return [_by_runtime_type(v) for v in value]
    return value


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_frames_are_the_runtime_type_encoding(message):
    assert encode(message) == msgpack.packb([message.TAG, _by_runtime_type(message)], use_bin_type=True)


@dataclasses.dataclass
class _Tree:  # a class that nests its own type (no message does yet; the codec must not care)
    value: int
    children: list[_Tree] = dataclasses.field(default_factory=list)
    data: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(2, np.int32))


def test_a_class_nesting_its_own_type_round_trips():
    from shared.messages.codec import _decoder, _encoder

    tree = _Tree(1, [_Tree(2, [_Tree(3, data=np.arange(3, dtype=np.int64))]), _Tree(4)])
    raw = _encoder(_Tree)(tree)
    assert raw == _by_runtime_type(tree)
    back = _decoder(_Tree)(msgpack.unpackb(msgpack.packb(raw, use_bin_type=True)))
    assert back.children[0].children[0].value == 3 and back.children[1].value == 4
    np.testing.assert_array_equal(back.children[0].children[0].data, np.arange(3))


@pytest.mark.parametrize("frame", [
    msgpack.packb([RequestOutput.TAG, ["r", 0, 5] + [None] * 14]),  # new_token_ids not a list
    msgpack.packb([RequestOutput.TAG, ["r", 0, [1], None, 0, 0, None, 0, [], [5], [], False, None, [], [], [],
                                       []]]),  # top_token_ids: a list of lists, got [5]
    msgpack.packb([Step.TAG, [0] * 18]),  # arrays not [dtype, shape, bytes]
])
def test_malformed_fields_raise_decode_error(frame):
    with pytest.raises(DecodeError):
        decode(frame)


def test_group_fields_default_to_one_rank():
    ready = decode(encode(ExecutorReady(0, 1, 10, 16, 64)))
    stats = decode(encode(EngineStats(0, 0, 10, 0, 0, 0, True)))
    assert (ready.all_reduce, ready.kv_cache_bytes, ready.sliding_window) == ("single", 0, 0)
    assert (stats.world_size, stats.all_reduce, stats.num_kv_blocks_per_rank, stats.kv_cache_bytes_per_rank) == (
        1, "single", [], [])


def test_request_output_defaults_to_not_finished():
    out = decode(encode(RequestOutput("r", 0, [1])))
    assert out.request_finished is False and out.finish_reason is None


@pytest.mark.parametrize("frame", [
    b"\x00not msgpack",
    msgpack.packb([999, []]),
    msgpack.packb([RequestOutput.TAG, ["r", 0]]),  # too few fields
    msgpack.packb([RequestOutputs.TAG, [[["r", 0]]]]),  # one of the outputs has too few
])
def test_bad_frames_raise_decode_error(frame):
    with pytest.raises(DecodeError):
        decode(frame)


def test_object_arrays_are_refused():
    tag, fields = msgpack.unpackb(encode(EXAMPLES[0]))
    fields[1][0] = "|O"  # the prompt's dtype
    with pytest.raises(DecodeError, match="not allowed"):
        decode(msgpack.packb([tag, fields]))


def test_unregistered_types_are_refused():
    with pytest.raises(TypeError):
        encode(SAMPLING)
