"""Whose fault a failed request is: a request that can never run is the client's (the frontend
answers 400); a step the executor could not run is the engine's (500). Checked on the scheduler's
outputs, through the wire codec."""

import numpy as np
import pytest

from shared.messages import StepResult
from tests.doubles.engine import InProcessEngine, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=5)


def test_a_request_that_can_never_run_is_the_requests_fault(model):
    engine = InProcessEngine(model, num_blocks=8, block_size=4)
    (out,) = engine.add("huge", list(range(1, 60)), temperature=0.0, max_tokens=4)
    assert out.finish_reason == "error" and out.error_kind == "request" and out.request_finished


def test_a_failed_step_fails_its_requests_as_the_engines_fault(model):
    engine = InProcessEngine(model, num_blocks=32, block_size=4)

    def broken(step):
        empty = np.zeros(0, np.int64)
        return StepResult(step.step_id, empty, empty, error="RuntimeError('boom')")

    engine.execute = broken
    assert engine.add("a", [3, 4, 5], temperature=0.0, max_tokens=4) == []
    assert engine.add("b", [6, 7], temperature=0.0, max_tokens=4) == []
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    for out in outs:
        assert out.finish_reason == "error" and out.error_kind == "engine" and out.request_finished
        assert "the executor failed" in out.error and "boom" in out.error
    assert not engine.has_work() and engine.blocks.num_used_blocks == 0
