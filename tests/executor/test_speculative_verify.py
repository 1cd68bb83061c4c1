"""Speculative decoding's verification: the acceptance rule keeps the target distribution (a
chi-squared bound on many seeded draws, shown to reject a wrong rule), greedy verification, the
rows a step with drafts samples, and the executor's token history after a rollback."""

import math

import numpy as np
import pytest
import torch

from services.executor.histories import TokenHistories
from services.executor.sampler import Sampler
from services.executor.speculative import accept_greedy, accept_random, verification_rows, verify
from shared.messages import NewSequence, SamplingParams, Step

NUM_DRAWS = 20000
Z = 3.29  # one-sided normal quantile of 0.9995: a correct rule fails 1 run in 2000


def chi2_bound(df: int) -> float:
    """The chi-squared quantile at ``Z`` (Wilson and Hilferty's approximation)."""
    a = 2 / (9 * df)
    return df * (1 - a + Z * math.sqrt(a)) ** 3


def chi2(counts: np.ndarray, p: np.ndarray) -> float:
    expected = p * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # a token of probability zero was emitted
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


P = np.array([0.05, 0.4, 0.1, 0.25, 0.2, 0.0])


def _emitted(rule, draft: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(1234)
    probs = torch.tensor(P, dtype=torch.float32).unsqueeze(0).repeat(2, 1)
    counts = np.zeros(len(P), np.int64)
    for _ in range(NUM_DRAWS):
        accepted, token = rule(probs, [draft], gen)
        counts[draft if accepted else token] += 1
    return counts


@pytest.mark.parametrize("draft", [1, 0, 5])  # likely, unlikely, impossible
def test_emitted_tokens_follow_the_target_distribution(draft):
    counts = _emitted(accept_random, draft)
    assert chi2(counts, P) < chi2_bound(int((P > 0).sum()) - 1)


def test_the_bound_rejects_a_wrong_acceptance_ratio():
    def wrong(probs, drafts, gen):  # accepts with sqrt(p(x)): too often, the test must see it
        x = drafts[0]
        if float(torch.rand(1, generator=gen)) < math.sqrt(float(probs[0, x])):
            return 1, x
        residual = probs[0].clone()
        residual[x] = 0
        return 0, int(torch.multinomial(residual, 1, generator=gen))

    counts = _emitted(wrong, 0)
    assert chi2(counts, P) > chi2_bound(int((P > 0).sum()) - 1)


def test_all_accepted_draws_the_token_after_the_last_draft():
    probs = torch.tensor([[0, 1.0, 0], [1.0, 0, 0], [0, 0, 1.0]])  # certain: drafts 1, 0; then 2
    accepted, token = accept_random(probs, [1, 0], torch.Generator().manual_seed(0))
    assert (accepted, token) == (2, 2)


def test_greedy_accepts_while_the_argmax_matches():
    best = np.array([4, 7, 9, 3])
    assert accept_greedy(best, np.array([4, 7, 9])) == (3, 3)
    assert accept_greedy(best, np.array([4, 8, 9])) == (1, 7)  # the argmax replaces the first miss
    assert accept_greedy(best, np.array([5, 7, 9])) == (0, 4)


def _sampler(**params):
    sampler = Sampler(seed=0)
    sampler.add(0, SamplingParams(**params))
    return sampler


def test_verify_uses_the_requests_processed_distribution_and_its_seed():
    """Temperature, top-k and logit bias, as the sampler applies them: the first token emitted over
    many verifications of draft 2 follows softmax(top-k(logits + bias) / T), computed here."""
    torch.manual_seed(0)
    logits = torch.randn(2, 8)
    params = dict(temperature=0.7, top_k=4, logit_bias_token_ids=[5], logit_bias_values=[1.5], seed=7)
    biased = logits[0].clone()
    biased[5] += 1.5
    kept = torch.full_like(biased, -math.inf)
    top = torch.topk(biased, 4).indices
    kept[top] = biased[top]
    p = torch.softmax(kept / 0.7, -1).numpy().astype(np.float64)
    draft = int(top[1])
    sampler = _sampler(**params)
    counts = np.zeros(8, np.int64)
    firsts = []
    for _ in range(2000):
        tokens, accepted = verify(sampler, logits, [0], np.array([2]), [np.array([draft])])
        first = draft if accepted[0] else int(tokens[0])
        counts[first] += 1
        firsts.append((int(tokens[0]), int(accepted[0])))
    assert chi2(counts, p / p.sum()) < chi2_bound(3)
    again = _sampler(**params)  # the same seed: the same verdicts
    assert [tuple(int(v[0]) for v in verify(again, logits, [0], np.array([2]), [np.array([draft])]))
            for _ in range(50)] == firsts[:50]


def test_verification_rows_are_every_row_of_a_speculating_sequence():
    step = Step(step_id=0, num_decodes=1, seq_ids=np.array([0, 1, 2]), input_token_ids=np.zeros(9, np.int64),
                positions=np.zeros(9, np.int64), slot_mapping=np.zeros(9, np.int64),
                query_start_loc=np.array([0, 1, 5, 9], np.int32), context_lens=np.zeros(3, np.int32),
                block_tables=np.zeros((3, 1), np.int32), sample_mask=np.array([True, True, False]),
                num_draft_tokens=np.array([0, 3, 0], np.int32))
    rows, counts = verification_rows(step)
    assert rows.tolist() == [0, 1, 2, 3, 4] and counts.tolist() == [1, 4]


def test_history_takes_the_token_fed_in_place_of_a_rejected_draft():
    h = TokenHistories()
    h.add(NewSequence(0, "r", SamplingParams(), np.array([1, 2, 3], np.int32), 2))

    def feed(first, tokens):
        n = len(tokens)
        h.observe(Step(step_id=0, num_decodes=0, seq_ids=np.array([0]), input_token_ids=np.array(tokens),
                       positions=np.arange(first, first + n), slot_mapping=np.zeros(n, np.int64),
                       query_start_loc=np.array([0, n], np.int32), context_lens=np.zeros(1, np.int32),
                       block_tables=np.zeros((1, 1), np.int32), sample_mask=np.array([True])))

    feed(2, [3, 7, 8, 9])  # the last token and three drafts
    assert h.token_ids(0) == [1, 2, 3, 7, 8, 9]
    feed(4, [5])  # draft 7 accepted, 8 rejected: 5 sampled in its place
    assert h.token_ids(0) == [1, 2, 3, 7, 5] and h.num_output_tokens(0) == 3
    feed(0, [1, 2, 3, 7, 5])  # a recompute feeds the same tokens: nothing changes
    assert h.token_ids(0) == [1, 2, 3, 7, 5]
