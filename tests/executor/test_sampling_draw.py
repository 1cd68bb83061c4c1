"""Random sampling without sorting the vocabulary: the inverse-CDF draw, and top-k / top-p over
the most likely candidates (a row is sorted whole only when its nucleus is larger)."""

from __future__ import annotations

import pytest
import torch

from services.executor import logits_processors as lp
from services.executor.draw import draw
from services.executor.sampler import Sampler
from shared.messages import SamplingParams

NEG_INF = float("-inf")


def reference_truncate(logits, min_p, top_k, top_p):
    """The definition: min-p, then top-k and top-p on a full descending sort of each row."""
    vocab = logits.shape[1]
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < torch.tensor(min_p).unsqueeze(1) * probs.amax(-1, keepdim=True), NEG_INF)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k]).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(torch.arange(vocab).unsqueeze(0) >= k, NEG_INF)
    probs = sorted_logits.softmax(-1)
    before = probs.cumsum(-1) - probs
    drop = before >= torch.tensor([p if p < 1.0 else float("inf") for p in top_p]).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    return torch.full_like(logits, NEG_INF).scatter(1, order, sorted_logits)


def rows_of(kind: str, num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Peaked rows (a language model's: a few likely tokens, a long tail) or flat ones."""
    g = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(num_rows, vocab, generator=g) * 0.5
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    return torch.stack([(-2.0 * ranks.log() + torch.randn(vocab, generator=g) * 0.3)[torch.randperm(vocab, generator=g)]
                        for _ in range(num_rows)])


@pytest.mark.parametrize("kind", ["peaked", "flat"])
def test_truncate_keeps_what_a_full_sort_keeps(kind):
    vocab = 4 * lp.TOP_P_CANDIDATES + 37
    settings = [  # (min_p, top_k, top_p): none, each alone, and together; top-k above the candidates
        (0.0, 0, 1.0), (0.0, 1, 1.0), (0.0, 20, 1.0), (0.0, lp.TOP_P_CANDIDATES + 50, 1.0), (0.0, vocab, 1.0),
        (0.0, 0, 0.5), (0.0, 0, 0.9), (0.0, 0, 0.999), (0.0, 0, 0.0), (0.0, 40, 0.8),
        (0.0, lp.TOP_P_CANDIDATES + 50, 0.95), (0.05, 0, 0.9), (0.2, 10, 1.0),
    ]
    logits = rows_of(kind, len(settings), vocab, seed=3)
    logits[1, :5] = NEG_INF  # banned tokens
    min_p, top_k, top_p = (list(col) for col in zip(*settings))
    got = lp.truncate(logits, min_p, top_k, top_p)
    want = reference_truncate(logits, min_p, top_k, top_p)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(got)], logits.masked_fill(~torch.isfinite(want), 0)[torch.isfinite(want)])
    assert torch.equal(got[0], logits[0])  # nothing asked: the row is untouched
    kept = torch.isfinite(got).sum(-1).tolist()
    assert kept[1] == 1 and kept[2] == 20 and kept[3] == lp.TOP_P_CANDIDATES + 50 and kept[8] == 1
    if kind == "flat":
        assert kept[7] > lp.TOP_P_CANDIDATES  # a nucleus larger than the candidates: sorted whole


def test_truncate_returns_the_logits_when_nothing_applies():
    logits = rows_of("peaked", 2, 100, seed=1)
    assert lp.truncate(logits, [0.0, 0.0], [0, 100], [1.0, 1.0]) is logits


def test_draw_follows_the_cumulative_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 2.0, 2.0]])
    num = 1000
    uniforms = torch.arange(num) / num  # an even grid over [0, 1): counts are exact
    picked = torch.stack([draw(probs, torch.full((2,), float(u))) for u in uniforms])  # [num, 2]
    assert torch.bincount(picked[:, 0], minlength=5).tolist() == [500, 0, 300, 200, 0]
    assert torch.bincount(picked[:, 1], minlength=5).tolist() == [0, 0, 0, 500, 500]  # unnormalized row


def test_draw_never_picks_a_zero_probability_token_and_flags_broken_rows():
    probs = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [float("nan"), 1.0, 0.0, 0.0]])
    almost_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()
    for u in (0.0, 0.5, almost_one):
        assert draw(probs, torch.full((3,), u)).tolist() == [1, -1, -1]


@pytest.mark.slow  # draws enough samples to compare frequencies
def test_sampled_frequencies_follow_the_temperature():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 0.0]]))
    sampler = Sampler(seed=0)
    sampler.add(0, SamplingParams(temperature=0.5))
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sampler.sample(logits, [0]).token_ids[0]] += 1
    want = torch.softmax(logits / 0.5, -1)[0]  # 0.78, 0.196, 0.022, 0
    assert counts[3] == 0
    assert torch.allclose(counts / 4000, want, atol=0.03)


def test_non_finite_rows_fall_back_to_argmax():
    sampler = Sampler(seed=0)
    sampler.add(0, SamplingParams(temperature=1.0))
    sampler.add(1, SamplingParams(temperature=1.0, top_k=1))
    logits = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 2.0, 1.0]])
    out = sampler.sample(logits, [0, 1]).token_ids.tolist()
    assert out == [torch.argmax(logits[0]).item(), 1]
