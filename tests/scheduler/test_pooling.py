"""``Pooling``, the scheduler's record of an embedding request's pooled hidden states: which rows
each chunk must pool, the sum kept across chunks, a recompute starting it over, and a chunk that
would leave a gap refused."""

from __future__ import annotations

import numpy as np
import pytest

from services.scheduler.pooling import Pooling
from shared.messages import RequestOutput, StepResult


def result(rows: np.ndarray) -> StepResult:
    return StepResult(0, np.zeros(0, np.int64), np.zeros(0, np.int64), pooled=rows.astype(np.float32))


def test_mean_pooling_sums_every_chunk_and_starts_over_from_position_zero():
    pooling = Pooling(10, "mean")
    assert pooling.needs_every_position
    assert pooling.num_rows(0, 4) == 4
    pooling.add(result(np.array([[4.0, 8.0]])), 0, 4)
    assert pooling.num_rows(4, 8) == 4
    pooling.add(result(np.array([[0.0, 0.0], [4.0, 4.0]])), 1, 4)
    assert pooling.num_rows(0, 6) == 6  # a recompute preemption: the sum starts over
    pooling.add(result(np.array([[6.0, 6.0]])), 0, 6)
    with pytest.raises(ValueError, match="pooled up to 6"):
        pooling.num_rows(8, 10)
    assert pooling.num_rows(6, 12) == 4  # only prompt positions
    pooling.add(result(np.array([[4.0, 14.0]])), 0, 4)
    assert pooling.complete and not pooling.needs_every_position
    out = RequestOutput("r", 0, [], "length")
    pooling.attach(out)
    np.testing.assert_array_equal(np.frombuffer(out.embedding, "<f4"), [1.0, 2.0])
    again = RequestOutput("r", 0, [], "length")
    pooling.attach(again)
    assert len(again.embedding) == 0  # once


def test_last_token_pooling_takes_only_the_last_prompt_position():
    pooling = Pooling(10, "last")
    assert not pooling.needs_every_position  # the last prompt token is always computed
    assert pooling.num_rows(0, 8) == 0
    out = RequestOutput("r", 0, [], "length")
    pooling.attach(out)
    assert len(out.embedding) == 0  # not complete yet
    assert pooling.num_rows(8, 10) == 1
    pooling.add(result(np.array([[3.0, -1.0]])), 0, 1)
    pooling.attach(out)
    np.testing.assert_array_equal(np.frombuffer(out.embedding, "<f4"), [3.0, -1.0])


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="pooling must be one of"):
        Pooling(3, "cls")


def test_chunks_are_asked_for_in_order_and_counted_when_their_results_come():
    pooling = Pooling(6, "mean")
    assert (pooling.num_rows(0, 3), pooling.num_rows(3, 6), pooling.num_rows(6, 7)) == (3, 3, 0)
    assert not pooling.complete
    pooling.add(result(np.array([[3.0]])), 0, 3)
    pooling.add(result(np.array([[9.0]])), 0, 3)
    assert pooling.complete and pooling.vector().tolist() == [2.0]
