"""A migration's steps (``services/scheduler/migration.py``), directly: every path the docs name is
allowed, every other step is refused, and a finished migration takes no step."""

import itertools

import pytest

from services.scheduler.migration import NEXT, Migration, MigrationError, Phase, block_key


def test_the_documented_paths():
    done = Migration("m", "r", 0, 1)
    for phase in (Phase.PAUSED, Phase.SEALED, Phase.IMPORTING, Phase.DONE):
        done.to(phase)
    assert done.finished and done.history == [Phase.PRECOPY, Phase.PAUSED, Phase.SEALED, Phase.IMPORTING, Phase.DONE]
    for stop in (Phase.PRECOPY, Phase.PAUSED, Phase.SEALED, Phase.IMPORTING):  # aborted from any of them
        m = Migration("m", "r", 0, 1)
        for phase in (Phase.PAUSED, Phase.SEALED, Phase.IMPORTING):
            if m.phase is stop:
                break
            m.to(phase)
        m.to(Phase.ABORTED, "why")
        assert m.finished and m.reason == "why"


@pytest.mark.parametrize("start,phase", [(a, b) for a, b in itertools.product(Phase, Phase) if b not in NEXT[a]])
def test_out_of_order_steps_are_refused(start, phase):
    m = Migration("m", "r", 0, 1, phase=start)
    with pytest.raises(MigrationError):
        m.to(phase)
    assert m.phase is start


def test_block_keys_are_unique_across_migrations():
    keys = {block_key(f"m{i}", j) for i in range(20) for j in range(50)}
    assert len(keys) == 1000 and all(len(k) == 16 for k in keys)
