"""Speculative decoding's scheduler side: the prompt-lookup proposer on crafted histories, the
config's validation, the policy (who speculates, how much, adaptation) and the rollback of blocks."""

import json

import pytest

from services.scheduler.block_manager import BlockManager
from services.scheduler.ngram import NgramProposer
from services.scheduler.sequence import Sequence
from services.scheduler.speculation import PAUSE_STEPS, Speculator, ineligible
from services.scheduler.stats import SchedulerStats
from shared.messages import SamplingParams
from shared.speculative import SpeculativeConfig, parse


def naive_propose(tokens, k, min_n, max_n):
    """The rule written plainly: longest suffix first; the latest earlier match followed by k
    tokens, else the earliest match."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        hits = [j for j in range(len(tokens) - n) if tokens[j:j + n] == suffix]
        if hits:
            whole = [j for j in hits if j + n + k <= len(tokens)]
            j = whole[-1] if whole else hits[0]
            return tokens[j + n:j + n + k]
    return []


def test_proposer_continues_the_longest_match():
    p = NgramProposer(1, 3)
    # "1 2 3" occurs earlier followed by 9 9; "2 3" alone occurs later followed by 7: the longer wins
    assert p.propose([1, 2, 3, 9, 9, 4, 2, 3, 7, 5, 1, 2, 3], 2) == [9, 9]
    assert p.propose([5, 6, 7, 8], 3) == []  # the suffix never occurred before
    assert p.propose([4, 4], 3) == [4]  # only one token followed the match
    assert p.propose([1, 2, 1, 2], 0) == []


def test_proposer_min_n_excludes_short_matches():
    assert NgramProposer(2, 3).propose([7, 1, 8, 2, 9, 3, 1], 2) == []  # only "1" recurs
    assert NgramProposer(1, 3).propose([7, 1, 8, 2, 9, 3, 1], 2) == [8, 2]


def test_proposer_prefers_a_recent_match_with_k_tokens_after_it():
    p = NgramProposer(1, 2)
    history = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert p.propose(history, 2) == [20, 21]  # the most recent "1 2" followed by two tokens
    assert p.propose(history, 8) == [10, 11, 1, 2, 20, 21, 1, 2]  # none has 8 after it: the earliest


@pytest.mark.parametrize("seed", range(6))
def test_proposer_equals_the_plain_rule_on_random_histories(seed):
    import random

    rng = random.Random(seed)
    p = NgramProposer(1, 4)
    for _ in range(50):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(1, 6)
        assert p.propose(tokens, k) == naive_propose(tokens, k, 1, 4), tokens


def test_config_parses_vllm_json_and_refuses_bad_values_in_one_line():
    cfg = parse(json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                            "prompt_lookup_max": 5}))
    assert cfg == SpeculativeConfig("ngram", 3, 2, 5)
    assert parse(None) is None and parse("") is None
    for bad, words in (('{"method": "eagle", "num_speculative_tokens": 3}', "not supported"),
                       ('{"method": "ngram", "num_speculative_tokens": 0}', "positive"),
                       ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,'
                        ' "prompt_lookup_max": 2}', "above"),
                       ('{"method": "ngram", "k": 2}', "unknown keys"),
                       ('{"num_speculative_tokens": 2}', "required"),
                       ("[1]", "JSON object"), ("{nope", "not JSON")):
        with pytest.raises(ValueError, match=words) as info:
            parse(bad)
        assert "\n" not in str(info.value)


def _seq(tokens, seq_id=0, **sampling):
    params = SamplingParams(**{"max_tokens": 100, "temperature": 0.0, **sampling})
    seq = Sequence(seq_id, "r", 0, list(tokens), params, frozenset(), 0.0)
    seq.num_computed_tokens = len(tokens) - 1  # decoding: its last token is still to feed
    return seq


def _speculator(k=4, num_blocks=64):
    blocks = BlockManager(num_blocks, 4, watermark=0.0)
    return Speculator(SpeculativeConfig("ngram", k, 1, 3), SchedulerStats(), blocks), blocks


REPEATING = [3, 4, 5, 6] * 5


def test_requests_that_cannot_be_verified_exactly_decode_without_speculation():
    assert ineligible(_seq(REPEATING)) is None
    assert ineligible(_seq(REPEATING, n=2)) is None  # parallel samples speculate each
    for sampling in ({"logprobs": 1}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.2},
                     {"min_tokens": 3}, {"guided": '{"json_object": true}'}, {"n": 2, "best_of": 3},
                     {"n": 2, "use_beam_search": True}):
        assert ineligible(_seq(REPEATING, **sampling)) is not None, sampling
        spec, _ = _speculator()
        assert spec.drafts(_seq(REPEATING, **sampling), 100, 0, 1000, False) == []


def test_drafts_never_pass_max_tokens_the_model_length_or_the_budget():
    spec, _ = _speculator(k=4)
    assert spec.drafts(_seq(REPEATING), 100, 0, 1000, False) == [3, 4, 5, 6]
    seq = _seq(REPEATING, max_tokens=3)
    assert spec.drafts(seq, 100, 0, 1000, False) == [3, 4]  # 2 accepted + 1 sampled = max_tokens
    assert spec.drafts(_seq(REPEATING), 100, 0, len(REPEATING) + 2, False) == [3]
    assert spec.drafts(_seq(REPEATING), 4, 1, 1000, False) == [3, 4]  # 1 for it, 1 for the next
    assert spec.drafts(_seq(REPEATING), 100, 0, 1000, True) == []  # requests wait: no proposals
    assert spec.drafts(_seq(REPEATING), 100, 0, 1000, False, num_running=8) == [3]  # the step's rows shared
    assert spec.drafts(_seq(REPEATING), 100, 0, 1000, False, num_running=4) == [3, 4, 5]
    assert spec.drafts(_seq(REPEATING), 100, 0, 1000, False, num_running=16) == []


def test_drafts_never_take_blocks_the_pool_lacks():
    spec, blocks = _speculator(k=4, num_blocks=6)
    seq = _seq(REPEATING)  # 20 tokens (19 computed) fill 5 blocks; 4 drafts need a sixth
    assert blocks.allocate_slots(seq.seq_id, 20)
    assert blocks.allocate_slots(1, 4)  # takes the last free block
    assert spec.drafts(seq, 100, 0, 1000, False) == []
    blocks.free(1)
    assert spec.drafts(seq, 100, 0, 1000, False) == [3, 4, 5, 6]


def test_low_acceptance_shortens_then_pauses_speculation():
    spec, _ = _speculator(k=4)
    seq = _seq(REPEATING)
    spec.drafts(seq, 100, 0, 1000, False)
    spec.record(seq.seq_id, 4, 0)
    shorter = spec.drafts(seq, 100, 0, 1000, False)
    assert 0 < len(shorter) < 4
    for _ in range(5):
        spec.record(seq.seq_id, max(1, len(shorter)), 0)
    paused = [spec.drafts(seq, 100, 0, 1000, False) for _ in range(PAUSE_STEPS)]
    assert paused == [[]] * PAUSE_STEPS
    assert len(spec.drafts(seq, 100, 0, 1000, False)) == 1  # tries again with one token
    stats = spec.stats
    assert all(a <= p for a, p in zip(stats.spec_accepted, stats.spec_proposed))


def test_rollback_frees_blocks_taken_only_for_rejected_tokens():
    blocks = BlockManager(16, 4, watermark=0.0)
    assert blocks.allocate_slots(0, 6)  # 2 blocks
    assert blocks.allocate_slots(0, 6 + 1 + 5, 6)  # 12 tokens: 3 blocks
    blocks.free_tail(0, 7)  # 1 of 5 drafts accepted: 7 tokens computed
    assert len(blocks.block_tables[0]) == 2
    blocks.check_integrity()
    assert blocks.num_free_blocks == 14
    blocks.free(0)
    blocks.check_integrity()
