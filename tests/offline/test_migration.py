"""Live migration between data-parallel replicas in one process (``services/offline_replicas.py``),
tiny random Llamas: greedy streams equal transformers' (and so an unmigrated run) when a request
moves mid-decode, twice (A -> B -> A), during its prefill, or while waiting; the target computes
nothing again (its steps hold one token per sequence); a target with no room, whose reads fail or
whose executors restart mid-copy leaves the request running on the source; n > 1 is refused with
a clear error; random interleavings keep both block managers' integrity (checked every step)."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from services.offline_replicas import ReplicatedEngine
from services.scheduler.migration import MigrationError, Phase
from shared.messages import AddRequest, SamplingParams
from tests.doubles.engine import InProcessEngine, hf_greedy, tiny_llama

MAX_NEW = 20
PROMPT = [int(t) for t in np.random.default_rng(3).integers(1, 128, 21)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=7)


@pytest.fixture(scope="module")
def reference(model):
    return hf_greedy(model, PROMPT, MAX_NEW)


_OPEN: list = []


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    while _OPEN:
        _OPEN.pop().close()  # their block-file directories


def _replicas(model, num_blocks=(32, 32), **options):
    cores = [InProcessEngine(model, num_blocks=n, block_size=4, **options) for n in num_blocks]
    _OPEN.append(ReplicatedEngine(cores, check=True))
    return _OPEN[-1]


def _request(rid="r", prompt=PROMPT, **sampling):
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True, **sampling})
    return AddRequest(rid, np.array(prompt, np.int32), params, 0.0)


def _run(engine, moves=(), rid="r"):
    """Step to the end; ``moves``: {step number: target replica} migrations started then."""
    tokens, n = [], 0
    moves = sorted(dict(moves).items())
    while engine.has_work():
        if moves and n >= moves[0][0] and rid not in engine.migrations:  # once the one before is over
            engine.migrate(rid, moves.pop(0)[1])
        for out in engine.step():
            assert out.error is None, out.error
            tokens += list(out.new_token_ids)
        n += 1
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_migrated_twice_continues_identically(model, reference, async_scheduling):
    engine = _replicas(model, async_scheduling=async_scheduling)
    engine.add_request(_request())
    engine.cores[1].max_tokens_in_step = 0
    assert _run(engine, {3: 1, 8: 0}) == reference
    assert [m.phase for m in engine.finished] == [Phase.DONE, Phase.DONE]
    assert engine.cores[1].max_tokens_in_step == 1  # the target only decoded: nothing recomputed
    assert not any(name.endswith(".kv") for _, _, names in os.walk(engine.directory) for name in names)
    engine.close()


def test_seeded_sampling_continues_its_random_stream(model):
    """No reference outside the engine samples our way: the unmigrated run of the same engine is it."""
    sampling = {"temperature": 1.0, "seed": 1234}
    plain = _replicas(model)
    plain.add_request(_request(**sampling))
    unmigrated = _run(plain)
    engine = _replicas(model)
    engine.add_request(_request(**sampling))
    assert _run(engine, {4: 1}) == unmigrated
    assert engine.finished[0].phase is Phase.DONE


def test_migration_during_prefill(model, reference):
    engine = _replicas(model, max_num_batched_tokens=6)  # the prompt is prefilled in chunks of 6
    engine.add_request(_request())
    assert _run(engine, {1: 1}) == reference
    assert engine.finished[0].phase is Phase.DONE
    assert engine.cores[1].max_tokens_in_step <= 6
    engine.close()


def test_waiting_request_moves(model, reference):
    engine = _replicas(model, max_num_seqs=1)
    engine.add_request(_request("busy", PROMPT[::-1]))
    engine.add_request(_request())  # waits behind "busy" on replica 0
    engine.step()
    engine.migrate("r", 1)
    tokens = {}
    while engine.has_work():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens["r"] == reference and engine.finished[0].phase is Phase.DONE


def test_target_without_room_keeps_it_on_the_source(model, reference):
    engine = _replicas(model, num_blocks=(32, 12))
    engine.add_request(_request())
    engine.add_request(_request("busy", (PROMPT * 2)[:30], max_tokens=16), replica=1)  # 8 to 12 of the 12 blocks
    tokens = {}
    for n in range(100):
        if n == 2:
            engine.migrate("r", 1)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_work():
            break
    assert tokens["r"] == reference
    (m,) = engine.finished
    assert m.phase is Phase.ABORTED and "no room" in m.reason


def test_failed_reads_keep_it_on_the_source(model, reference):
    engine = _replicas(model)
    engine.add_request(_request())
    for _ in range(4):
        engine.step()
    m = engine.migrate("r", 1)
    engine.step()  # pre-copy written
    for root, _, names in os.walk(engine.directory):
        for name in names:
            if name.endswith(".kv"):
                os.unlink(os.path.join(root, name))  # the bytes are lost on the way
    tokens = []
    while engine.has_work():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert m.phase is Phase.ABORTED and "could not be read" in m.reason
    full = hf_greedy(model, PROMPT, MAX_NEW)
    assert tokens == full[len(full) - len(tokens):]  # the rest of the stream, from the source


def test_target_executors_restart_mid_copy(model, reference):
    engine = _replicas(model)
    engine.add_request(_request())
    tokens = []
    for n in range(60):
        if n == 3:
            m = engine.migrate("r", 1)
        if m_importing := (n > 3 and m.phase is Phase.IMPORTING):
            target = engine.cores[1]
            target.scheduler.reset_executor_state("killed")
            target.migrations.reset()
        tokens += [t for out in engine.step() for t in out.new_token_ids]
        if not engine.has_work():
            break
    assert tokens == reference
    assert m.phase is Phase.ABORTED and "restarted" in m.reason


def test_n_greater_than_one_is_refused(model):
    engine = _replicas(model)
    engine.add_request(_request(n=2, temperature=1.0, seed=1))
    engine.step()
    with pytest.raises(MigrationError, match="n > 1"):
        engine.migrate("r", 1)
    with pytest.raises(MigrationError, match="unknown request"):
        engine.migrate("nope", 1)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 2), st.integers(0, 1)), max_size=4))
def test_random_migrations_keep_streams_and_integrity(model, moves):
    """Three requests on three replicas, migrations started at random steps (refused ones ignored):
    every stream equals an unmigrated one; integrity is checked on every replica every step."""
    cores = [InProcessEngine(model, num_blocks=24, block_size=4) for _ in range(3)]
    engine = ReplicatedEngine(cores, check=True)
    prompts = {f"q{i}": PROMPT[i:i + 9 + 4 * i] for i in range(3)}
    for i, (rid, p) in enumerate(prompts.items()):
        engine.add_request(_request(rid, p, max_tokens=8), replica=i)
    tokens, n = {}, 0
    while engine.has_work():
        for step, rid_idx, delta in moves:
            if step == n and f"q{rid_idx}" in engine.owner and f"q{rid_idx}" not in engine.migrations:
                source = engine.owner[f"q{rid_idx}"]
                try:
                    engine.migrate(f"q{rid_idx}", (source + 1 + delta) % 3)
                except MigrationError:
                    pass
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        n += 1
        assert n < 200
    for rid, p in prompts.items():
        assert tokens[rid] == _reference(model, p), rid
    engine.close()


_REFS: dict = {}


def _reference(model, prompt):
    key = tuple(prompt)
    if key not in _REFS:
        _REFS[key] = hf_greedy(model, list(prompt), 8)
    return _REFS[key]
