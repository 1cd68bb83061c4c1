"""The data-parallel router's policy, directly: prefix affinity, load balance within the slack,
availability, forgetting a restarted replica, and the bound on what it remembers."""

import numpy as np
import pytest

from services.frontend.replica_router import ReplicaRouter

SYSTEM = list(range(1000, 1048))  # 48 tokens: three full chunks of 16


def _prompt(tail: int, prefix: list[int] = SYSTEM) -> list[int]:
    return prefix + [tail, tail + 1, tail + 2]


def test_unrelated_prompts_take_turns_on_an_idle_server():
    router = ReplicaRouter(3)
    chosen = [router.choose(list(range(t * 100, t * 100 + 40)), [0, 0, 0], [True] * 3) for t in range(6)]
    assert [r.replica for r in chosen] == [0, 1, 2, 0, 1, 2]
    assert not any(r.by_prefix for r in chosen) and all(r.matched_tokens == 0 for r in chosen)


def test_a_shared_prefix_goes_where_it_went_before():
    router = ReplicaRouter(2)
    first = router.choose(_prompt(1), [0, 0], [True, True])
    other = router.choose(list(range(5000, 5040)), [1 if first.replica == 0 else 0, 1 if first.replica == 1 else 0],
                          [True, True])
    assert other.replica != first.replica  # the idle one
    loads = [1, 1]
    again = router.choose(_prompt(9), loads, [True, True])
    assert again.replica == first.replica and again.by_prefix and again.matched_tokens == 48


def test_the_longest_match_wins():
    router = ReplicaRouter(2)
    short = SYSTEM[:16] + list(range(7000, 7040))  # shares SYSTEM's first chunk
    assert router.choose(short, [0, 0], [True, True]).replica == 0
    assert router.choose(_prompt(1), [0, 0], [False, True]).replica == 1  # all three chunks, at replica 1
    route = router.choose(_prompt(2), [0, 0], [True, True])
    assert route.replica == 1 and route.by_prefix and route.matched_tokens == 48
    route = router.choose(SYSTEM[:16] + [1, 2, 3], [0, 0], [True, True])  # one chunk: both match; ties, lighter
    assert route.by_prefix and route.matched_tokens == 16


def test_a_busy_replica_shares_its_prefix_beyond_the_slack():
    router = ReplicaRouter(2, min_slack=4)
    assert router.choose(_prompt(0), [0, 0], [True, True]).replica == 0
    assert router.choose(_prompt(1), [4, 0], [True, True]).replica == 0  # 4 <= 0 + 4: still there
    overflow = router.choose(_prompt(2), [5, 0], [True, True])  # 5 > 0 + 4: the idle one
    assert overflow.replica == 1 and not overflow.by_prefix
    # both hold the prefix now: the lighter of the two takes it
    assert router.choose(_prompt(3), [3, 2], [True, True]).replica == 1
    assert router.choose(_prompt(4), [2, 3], [True, True]).replica == 0


def test_the_slack_grows_with_the_load():
    router = ReplicaRouter(2, min_slack=4, slack_fraction=0.5)
    router.choose(_prompt(0), [0, 0], [True, True])
    assert router.choose(_prompt(1), [30, 20], [True, True]).replica == 0  # 30 <= 20 + 10
    assert router.choose(_prompt(2), [31, 20], [True, True]).replica == 1


def test_only_available_replicas_are_chosen():
    router = ReplicaRouter(3)
    router.choose(_prompt(0), [0, 0, 0], [True, True, True])  # replica 0 learns the prefix
    route = router.choose(_prompt(1), [0, 0, 0], [False, True, True])
    assert route.replica in (1, 2) and not route.by_prefix
    assert all(router.choose(list(range(t, t + 20)), [0, 0, 0], [False, False, True]).replica == 2 for t in range(4))
    with pytest.raises(ValueError, match="no replica is available"):
        router.choose(_prompt(2), [0, 0, 0], [False, False, False])


def test_a_forgotten_replica_matches_nothing():
    router = ReplicaRouter(2)
    router.choose(_prompt(0), [0, 0], [True, True])
    router.forget(0)
    assert router.num_chunks(0) == 0
    route = router.choose(_prompt(1), [0, 0], [True, True])
    assert not route.by_prefix and route.matched_tokens == 0


def test_short_prompts_go_by_load_and_numpy_prompts_hash_like_lists():
    router = ReplicaRouter(2)
    assert router.chunk_hashes(list(range(15))) == []
    assert router.chunk_hashes(np.asarray(SYSTEM, np.int32)) == router.chunk_hashes(SYSTEM)
    assert len(router.chunk_hashes(SYSTEM + [1])) == 3
    # chained: a chunk's hash depends on the chunks before it
    assert router.chunk_hashes([0] * 16 + SYSTEM[:16])[1] != router.chunk_hashes(SYSTEM[:16])[0]
    assert router.choose([1, 2, 3], [2, 1], [True, True]).replica == 1


def test_what_it_remembers_is_bounded_oldest_first():
    router = ReplicaRouter(1, max_chunks_per_replica=4)
    a, b = list(range(0, 48)), list(range(100, 148))
    router.choose(a, [0], [True])
    assert router.num_chunks(0) == 3
    router.choose(b, [0], [True])
    assert router.num_chunks(0) == 4
    assert router.choose(b, [0], [True]).matched_tokens == 48
    assert router.choose(a, [0], [True]).matched_tokens == 0  # a's first chunks went first


def test_bad_arguments():
    with pytest.raises(ValueError):
        ReplicaRouter(0)
    with pytest.raises(ValueError, match="expected 2"):
        ReplicaRouter(2).choose(SYSTEM, [0], [True])
