"""``GuidedSequences.masks``: the guided rows of a step filled together by llguidance's
``fill_next_token_bitmask_par`` give the masks ``mask`` gives each row alone (JSON schemas at
different points of their documents, regexes, choices, a finished guide, outputs that left their
guide, a spec that cannot be followed), over several steps as the sequences grow; one row takes
the single path."""

from __future__ import annotations

import json

import llguidance.numpy
import numpy as np
import pytest

from services.executor.guided import GuidedSequences, GuideUnavailable, vocabulary_of
from services.executor.histories import TokenHistories
from shared.messages import SamplingParams
from tests.doubles.fake_scheduler import cached_tokenizer
from tests.executor.test_guided_decoding import SCHEMA, sequence

SPECS = [json.dumps({"json_schema": SCHEMA}), json.dumps({"regex": r"(yes|no)-[0-9]{2,4}!"}),
         json.dumps({"choice": ["Paris", "Tokyo", "東京"]}), json.dumps({"json_object": True})]
# the outputs so far of sequence i, under SPECS[i % 4]
OUTPUTS = ['{"ok": true, "n": 1', 'no-12', '東', '{"a": [1, 2', '{"ok": false, "s": "a€', 'yes-', 'Pa', '', '',
           'no-1234', 'Paris', '{"x": "東京"']


@pytest.fixture(scope="module")
def tokenizer():
    return cached_tokenizer()


@pytest.fixture(scope="module")
def vocabulary(tokenizer):
    return vocabulary_of(tokenizer, len(tokenizer))


def guided_rows(tokenizer, vocabulary) -> tuple[GuidedSequences, TokenHistories, list[tuple[int, list[int]]]]:
    histories = TokenHistories()
    guided = GuidedSequences(histories, lambda: vocabulary)
    rows = []
    for seq_id, text in enumerate(OUTPUTS):
        outputs = tokenizer.encode(text, add_special_tokens=False)
        histories.add(sequence(seq_id, [1, 2], outputs, SamplingParams()))
        guided.add(seq_id, SPECS[seq_id % len(SPECS)])
        rows.append((seq_id, [tokenizer.eos_token_id]))
    histories.add(sequence(90, [1], [len(tokenizer) + 3], SamplingParams()))  # left its guide: may only end
    guided.add(90, SPECS[1])
    histories.add(sequence(91, [1], [], SamplingParams()))
    guided.add(91, json.dumps({"regex": "a[0-9"}))  # cannot be followed: that row fails alone
    return guided, histories, rows + [(90, [0]), (91, [0])]


def test_masks_filled_together_equal_each_alone(tokenizer, vocabulary, monkeypatch):
    together, histories, rows = guided_rows(tokenizer, vocabulary)
    alone, alone_histories, _ = guided_rows(tokenizer, vocabulary)
    calls = []
    fill = llguidance.numpy.fill_next_token_bitmask_par
    monkeypatch.setattr(llguidance.numpy, "fill_next_token_bitmask_par",
                        lambda executor, matchers, bitmask: calls.append(len(matchers)) or fill(executor, matchers,
                                                                                               bitmask))
    size, rng = len(tokenizer), np.random.default_rng(0)
    for step in range(4):
        batch = together.masks(rows)
        assert len(calls) == step + 1 and calls[-1] >= 2  # one call for the rows that were filled
        for (seq_id, eos), got in zip(rows, batch):
            try:
                want = alone.mask(seq_id, eos)
            except GuideUnavailable as exc:
                assert isinstance(got, GuideUnavailable) and str(got) == str(exc)
                continue
            assert (got.as_mask(size) == want.as_mask(size)).all(), (step, seq_id)
            allowed = np.setdiff1d(np.flatnonzero(want.as_mask(size)), eos)  # going on, where it may
            if len(allowed) and seq_id < 90:  # both histories grow by the same allowed token
                token = int(rng.choice(allowed))
                for h in (histories, alone_histories):
                    h._token_ids[seq_id].append(token)
    assert calls[0] >= 8 and not together.masks([])
    one = together.masks(rows[:1])
    assert len(calls) == 4 and (one[0].as_mask(size) == alone.mask(*rows[0]).as_mask(size)).all()  # single path
