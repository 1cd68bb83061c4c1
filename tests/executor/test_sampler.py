"""The executor's sampler: logits processing, sampling, seeds, logprobs and token histories."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.executor import logits_processors as lp
from services.executor.sampler import Sampler
from shared.messages import NewSequence, SamplingParams, Step

VOCAB = 10
NEG_INF = float("-inf")


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def step_of(chunks: list[tuple[int, int, list[int]]]) -> Step:
    """A Step feeding, per sequence, ``(seq_id, start position, new tokens)`` (slots and block tables
    do not matter to the sampler)."""
    tokens = [t for _, _, toks in chunks for t in toks]
    positions = [p for _, start, toks in chunks for p in range(start, start + len(toks))]
    qsl = np.cumsum([0] + [len(toks) for _, _, toks in chunks]).astype(np.int32)
    context_lens = np.array([start + len(toks) for _, start, toks in chunks], np.int32)
    return Step(0, 0, np.array([c[0] for c in chunks], np.int64), np.array(tokens, np.int64),
                np.array(positions, np.int64), np.array(positions, np.int64), qsl, context_lens,
                np.zeros((len(chunks), 1), np.int32), np.ones(len(chunks), bool))


def announce(sampler: Sampler, seq_id: int, params: SamplingParams, token_ids: list[int],
             num_prompt_tokens: int | None = None) -> None:
    """What the runner does with a step's ``NewSequence``."""
    new = NewSequence(seq_id, f"r{seq_id}", params, np.array(token_ids, np.int32),
                      len(token_ids) if num_prompt_tokens is None else num_prompt_tokens)
    sampler.add(seq_id, params)
    sampler.histories.add(new)


def test_greedy_without_processing_is_argmax_and_leaves_logits_alone():
    sampler = Sampler()
    sampler.add(0, SamplingParams(temperature=0.0))
    logits = logits_of([0.0, 3.0, 1.0, 2.0])
    out = sampler.sample(logits, [0])
    assert out.token_ids.tolist() == [1] and len(out.logprobs) == 0
    assert logits.tolist() == [[0.0, 3.0, 1.0, 2.0]]


def test_logit_bias_is_added_before_sampling():
    sampler = Sampler()
    sampler.add(0, SamplingParams(temperature=0.0, logit_bias_token_ids=[0], logit_bias_values=[100.0]))
    sampler.add(1, SamplingParams(temperature=0.0, logit_bias_token_ids=[1], logit_bias_values=[-100.0]))
    sampler.add(2, SamplingParams(temperature=1.0, seed=3, logit_bias_token_ids=[2], logit_bias_values=[100.0]))
    sampler.add(3, SamplingParams(temperature=0.0, logit_bias_token_ids=[99], logit_bias_values=[100.0],
                                  min_tokens=1, stop_token_ids=[98]))  # beyond the logits: ignored
    row = [0.0, 3.0, 1.0, 2.0]
    assert sampler.sample(logits_of(row, row, row, row), [0, 1, 2, 3]).token_ids.tolist() == [0, 3, 2, 1]


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    sampler = Sampler()
    announce(sampler, 0, SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3], eos_token_ids=[1]), [9])
    announce(sampler, 1, SamplingParams(temperature=0.0, min_tokens=2, eos_token_ids=[1], ignore_eos=True), [9])
    row = [0.0, 5.0, 1.0, 4.0]
    assert sampler.sample(logits_of(row, row), [0, 1]).token_ids.tolist() == [2, 1]  # EOS and stop banned
    sampler.histories.observe(step_of([(0, 1, [2]), (1, 1, [1])]))  # the decodes feed the outputs back
    assert sampler.sample(logits_of(row, row), [0, 1]).token_ids.tolist() == [2, 1]
    sampler.histories.observe(step_of([(0, 2, [2]), (1, 2, [1])]))
    assert sampler.sample(logits_of(row, row), [0, 1]).token_ids.tolist() == [1, 1]  # two outputs: free


def test_penalties_follow_hf_and_openai():
    logits = logits_of([2.0, -2.0, 1.0, 1.0, 1.0])
    out = lp.apply_penalties(logits, prompt_tokens=[np.array([0, 1])], output_tokens=[np.array([2, 2, 3])],
                             repetition=[2.0], presence=[0.0], frequency=[0.0])
    assert out.tolist() == [[1.0, -4.0, 0.5, 0.5, 1.0]]  # prompt and output count; divide +, multiply -
    out = lp.apply_penalties(logits, prompt_tokens=[np.array([0, 1])], output_tokens=[np.array([2, 2, 3, -1])],
                             repetition=[1.0], presence=[0.5], frequency=[0.25])
    assert out.tolist() == [[2.0, -2.0, 1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25, 1.0]]  # output only; -1 skipped


def test_truncation_min_p_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    out = lp.truncate(logits, min_p=[0.0, 0.2, 0.0, 0.0], top_k=[0, 0, 2, 0], top_p=[1.0, 1.0, 1.0, 0.8])
    kept = torch.isfinite(out).tolist()
    assert kept == [
        [True, True, True, True],  # nothing asked
        [True, True, True, False],  # min_p 0.2: below 0.1 goes
        [True, True, False, False],  # top_k 2
        [True, True, False, False],  # top_p 0.8: 0.5 + 0.3 reaches it
    ]
    assert torch.equal(out[0], logits[0])


def test_seeded_requests_repeat_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(2, 50)

    def draws(seeds: list[int | None], rows: torch.Tensor, shared_seed: int) -> list[int]:
        sampler = Sampler(seed=shared_seed)
        for seq_id, seed in enumerate(seeds):
            sampler.add(seq_id, SamplingParams(temperature=1.0, top_p=0.95, seed=seed))
        return [sampler.sample(rows, list(range(len(seeds)))).token_ids[0].item() for _ in range(30)]

    alone = draws([7], logits[:1], shared_seed=0)
    assert draws([7, None], logits, shared_seed=1) == alone  # an unseeded neighbour changes nothing
    assert draws([8], logits[:1], shared_seed=0) != alone
    assert len(set(alone)) > 1  # it does sample


def test_logprobs_are_raw_and_ranked():
    sampler = Sampler()
    sampler.add(0, SamplingParams(temperature=0.0, logprobs=2, logit_bias_token_ids=[3], logit_bias_values=[50.0]))
    sampler.add(1, SamplingParams(temperature=0.0))
    sampler.add(2, SamplingParams(temperature=0.0, logprobs=0))
    logits = logits_of([1.0, 3.0, 2.0, 0.0], [1.0, 3.0, 2.0, 0.0], [4.0, 3.0, 2.0, 0.0])
    out = sampler.sample(logits, [0, 1, 2])
    raw = torch.log_softmax(logits, -1)
    assert out.token_ids.tolist() == [3, 1, 0]
    assert out.logprobs.tolist() == pytest.approx([raw[0, 3].item(), raw[1, 1].item(), raw[2, 0].item()])
    assert out.top_token_ids.shape == (3, 2) and out.top_token_ids[0].tolist() == [1, 2]  # raw ranking
    assert out.top_logprobs[0].tolist() == pytest.approx([raw[0, 1].item(), raw[0, 2].item()])


def test_history_follows_chunks_decodes_recompute_and_forks():
    sampler = Sampler()
    histories = sampler.histories
    announce(sampler, 0, SamplingParams(temperature=0.0, repetition_penalty=1.5), [5, 6, 7, 8, 9])
    announce(sampler, 1, SamplingParams(temperature=0.0), [1, 2, 3])
    histories.observe(step_of([(0, 0, [5, 6, 7, 8]), (1, 0, [1, 2, 3])]))  # chunk 1 of 0's prompt: known
    histories.observe(step_of([(0, 4, [9])]))  # the last chunk
    assert histories.token_ids(0) == [5, 6, 7, 8, 9] and histories.token_ids(1) == [1, 2, 3]
    assert histories.num_output_tokens(0) == 0
    row = [0.0] * VOCAB
    row[4] = 1.0
    assert sampler.sample(logits_of(row), [0]).token_ids.tolist() == [4]
    histories.observe(step_of([(0, 5, [4])]))  # decode: feeds back the sampled token
    assert histories.token_ids(0) == [5, 6, 7, 8, 9, 4] and histories.num_output_tokens(0) == 1
    # Sampled 4 again, then preempted before it was fed: the re-prefill feeds everything from the
    # start, and only its last token is new.
    histories.observe(step_of([(0, 0, [5, 6, 7, 8, 9, 4, 4])]))
    assert histories.token_ids(0) == [5, 6, 7, 8, 9, 4, 4] and histories.num_prompt_tokens(0) == 5
    # A beam forked from 0 with one more token of its own arrives with all its tokens.
    announce(sampler, 2, SamplingParams(temperature=0.0, repetition_penalty=1.5), [5, 6, 7, 8, 9, 4, 4, 1], 5)
    histories.observe(step_of([(0, 7, [4]), (2, 7, [1])]))
    assert histories.token_ids(2) == [5, 6, 7, 8, 9, 4, 4, 1] and histories.num_output_tokens(2) == 3
    assert histories.token_ids(0) == [5, 6, 7, 8, 9, 4, 4, 4]
    with pytest.raises(ValueError, match="position 10, but only 8 of its tokens"):
        histories.observe(step_of([(2, 10, [3])]))  # a gap: the scheduler and executor disagree
    sampler.remove(2)
    histories.remove(2)
    assert 2 not in histories and len(histories) == 2


def test_prefix_cached_prompt_counts_for_repetition_but_not_presence():
    sampler = Sampler()
    announce(sampler, 1, SamplingParams(temperature=0.0, repetition_penalty=2.0), [1, 1, 1, 1, 2])
    announce(sampler, 2, SamplingParams(temperature=0.0, presence_penalty=2.0), [1, 1, 1, 1, 2])
    # Both reuse a cached block for their first four tokens and compute only their last prompt token.
    sampler.histories.observe(step_of([(1, 4, [2]), (2, 4, [2])]))
    row = [1.2, 2.0, 1.0] + [0.0] * (VOCAB - 3)
    assert sampler.sample(logits_of(row, row), [1, 2]).token_ids.tolist() == [0, 1]


def test_penalized_greedy_uses_prompt_and_outputs():
    sampler = Sampler()
    announce(sampler, 0, SamplingParams(temperature=0.0, presence_penalty=2.0), [1])
    announce(sampler, 1, SamplingParams(temperature=0.0, repetition_penalty=2.0), [1])
    sampler.histories.observe(step_of([(0, 0, [1]), (1, 0, [1])]))
    row = [0.0, 3.0, 2.0] + [0.0] * (VOCAB - 3)
    # presence counts outputs only: token 1 is in the prompt, not penalized; repetition halves it.
    assert sampler.sample(logits_of(row, row), [0, 1]).token_ids.tolist() == [1, 2]
    sampler.histories.observe(step_of([(0, 1, [1]), (1, 1, [2])]))  # the decodes feed them back
    # 0: 3 - 2 < 2 now that 1 is an output. 1: both seen, both halved: 1.5 > 1.
    assert sampler.sample(logits_of(row, row), [0, 1]).token_ids.tolist() == [2, 1]


def test_bfloat16_logits_sample_as_their_float32_cast():
    """A bf16 model's logits reach the sampler unwidened (``compute_logits``): every path (greedy,
    processed, random, logprobs) gives what their exact float32 cast gives."""
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(6, 300, generator=g)).bfloat16()
    logits[0, [7, 250]] = logits[0].max() + 1  # a tie: the first index wins either way
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.0, logit_bias_token_ids=[5], logit_bias_values=[2.5]),
              SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=11, top_k=40, logprobs=2),
              SamplingParams(temperature=1.2, seed=12, top_p=0.9)]
    outs = []
    for widened in (False, True):
        sampler = Sampler(seed=5)
        for seq_id, p in enumerate(params):
            announce(sampler, seq_id, p, [5, 7, 9, 250])
        outs.append(sampler.sample(logits.float() if widened else logits, list(range(len(params)))))
    got, want = outs
    assert got.token_ids.dtype == torch.int64 and got.token_ids.tolist() == want.token_ids.tolist()
    assert got.token_ids[0] == 7
    for name in ("logprobs", "top_token_ids", "top_logprobs"):
        assert np.array_equal(getattr(got, name), getattr(want, name))
    assert logits.dtype == torch.bfloat16  # not modified in place
