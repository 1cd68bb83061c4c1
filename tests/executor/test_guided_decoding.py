"""Guided decoding on the executor (``services/executor/guided.py``, ``vocabulary.py``): the
vocabulary's masks equal a token-by-token check, the sampler keeps guided rows inside their guide,
and the offline engine's output on a random model (which goes everywhere the mask lets it) is always
what the guide says."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.executor.guided import GuidedSequences
from services.executor.histories import TokenHistories
from services.executor.sampler import Sampler
from services.executor.token_bytes import token_bytes
from services.executor.vocabulary import Vocabulary
from services.offline import LLM
from shared.messages import NewSequence, SamplingParams
from shared.structured import compile_guide
from tests.doubles.fake_scheduler import cached_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer"},
        "tag": {"enum": ["x", "yz", 7]},
        "s": {"type": "string", "maxLength": 4},
    },
    "required": ["ok", "n"],
}


def conforms(value) -> bool:
    """``value`` is an instance of SCHEMA (checked by hand, not by the guide)."""
    if not isinstance(value, dict) or not {"ok", "n"} <= set(value) or set(value) - set(SCHEMA["properties"]):
        return False
    return (isinstance(value["ok"], bool) and type(value["n"]) is int
            and value.get("tag", "x") in ("x", "yz", 7) and len(value.get("s", "")) <= 4
            and isinstance(value.get("s", ""), str))


@pytest.fixture(scope="module")
def tokenizer():
    return cached_tokenizer()


@pytest.fixture(scope="module")
def vocabulary(tokenizer):
    return Vocabulary(token_bytes(tokenizer, len(tokenizer)))


def test_token_bytes_are_what_the_tokenizer_writes(tokenizer):
    pieces = token_bytes(tokenizer, len(tokenizer) + 3)
    assert pieces[-3:] == [None, None, None]  # ids the model has and the tokenizer does not
    assert all(pieces[i] is None for i in tokenizer.all_special_ids)
    text = 'Héllo {"a": [1, 2]}\n\t€ 😀 "quoted\\"'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(pieces[i] for i in ids) == text.encode()


def brute_force(guide, state, pieces) -> np.ndarray:
    return np.array([bool(p) and guide.advance_bytes(state, p) is not None for p in pieces])


@pytest.mark.parametrize("spec, prefixes", [
    ({"json_object": True}, ["", "{", '{"na', '{"a": ', '{"a": "Bo', '{"a": 1', '{"a": [', '{"a": tr', '{"a": "\\']),
    ({"json_schema": SCHEMA}, ["", "{", '{"', '{"ok": true, "n": -', '{"ok": true, "n": 1, "s": "',
                               '{"ok": true, "n": 1, "s": "ab', '{"ok": false, "n": 2, "tag": ']),
    ({"choice": ["Positive", "Negative", "Neutral"]}, ["", "Ne", "Neutral"]),
    ({"json_object": True}, [b'{"a": "\xe2\x82', b'{"a": "\xf0']),  # inside a multi-byte character
])
def test_masks_equal_checking_every_token(vocabulary, spec, prefixes):
    guide = compile_guide(spec)
    for prefix in prefixes:
        state = guide.advance_bytes(guide.initial(), prefix if isinstance(prefix, bytes) else prefix.encode())
        mask = vocabulary.allowed(guide, state)
        assert (mask == brute_force(guide, state, vocabulary.pieces)).all(), prefix
        assert mask.any() or not guide.can_continue(state)


def sequence(seq_id: int, prompt: list[int], outputs: list[int], params: SamplingParams) -> NewSequence:
    return NewSequence(seq_id=seq_id, request_id=str(seq_id), token_ids=np.asarray(prompt + outputs, np.int32),
                       num_prompt_tokens=len(prompt), sampling=params)


def test_the_sampler_keeps_guided_rows_in_their_guide_and_leaves_the_others(tokenizer, vocabulary):
    eos = [tokenizer.eos_token_id]
    guided = SamplingParams(temperature=0.0, guided=json.dumps({"choice": ["yes", "no"]}), eos_token_ids=eos)
    free = SamplingParams(temperature=0.0, eos_token_ids=eos)
    sampler = Sampler()
    sampler.guided.load_vocabulary = lambda: vocabulary
    done = tokenizer.encode("yes", add_special_tokens=False)
    for seq_id, outputs, params in ((1, [], guided), (2, [], free), (3, done, guided)):
        new = sequence(seq_id, [5, 6], outputs, params)
        sampler.add(seq_id, params)
        sampler.histories.add(new)
    logits = torch.zeros(3, len(tokenizer))
    favourite = tokenizer.encode(" maybe", add_special_tokens=False)[0]
    logits[:, favourite] = 10.0
    tokens = sampler.sample(logits, [1, 2, 3]).token_ids.tolist()
    assert tokenizer.decode([tokens[0]]) in {"y", "ye", "yes", "n", "no"}
    assert tokens[1] == favourite
    assert tokens[2] == tokenizer.eos_token_id  # "yes" is complete, and nothing may follow it
    # min_tokens bans the EOS the finished guide needs: the guide wins rather than an empty row
    banned = SamplingParams(temperature=0.0, guided=guided.guided, eos_token_ids=eos, min_tokens=10)
    sampler.add(4, banned)
    sampler.histories.add(sequence(4, [5], done, banned))
    assert sampler.sample(logits[:1], [4]).token_ids.tolist() == [tokenizer.eos_token_id]


def test_token_sets_keep_the_shorter_list():
    from services.executor.token_set import TokenSet

    few = TokenSet.from_mask(np.array([False, True, False, False]))
    most = TokenSet.from_mask(np.array([True, True, False, True]))
    assert few.keep and few.ids.tolist() == [1] and not most.keep and most.ids.tolist() == [2]
    assert few.adding([3]).as_mask(4).tolist() == [False, True, False, True]
    assert most.adding([2]).as_mask(4).all() and TokenSet(True, np.zeros(0, np.int64)).empty
    assert few.only_among([1, 7]) and not few.only_among([7]) and not most.only_among([0, 1, 3])


def test_a_sequence_state_follows_its_history_through_a_restart(tokenizer, vocabulary):
    sampler = Sampler()
    sampler.guided.load_vocabulary = lambda: vocabulary
    params = SamplingParams(guided=json.dumps({"json_schema": SCHEMA}), eos_token_ids=[tokenizer.eos_token_id])
    outputs = tokenizer.encode('{"ok": true, "n": 1', add_special_tokens=False)
    sampler.add(9, params)
    sampler.histories.add(sequence(9, [1, 2], outputs, params))
    size = vocabulary.size
    before = sampler.guided.mask(9, params.eos_token_ids).as_mask(size)
    fresh = GuidedSequences(sampler.histories, lambda: vocabulary)  # a new executor: only the history
    fresh.add(9, params.guided)
    after = fresh.mask(9, params.eos_token_ids).as_mask(size)
    assert (before == after).all()
    digits = [tokenizer.decode([i]) for i in np.flatnonzero(after)]
    assert "2" in digits and "}" in digits and "," in digits and '"' not in digits
    off = GuidedSequences(sampler.histories, lambda: vocabulary)
    off.add(9, json.dumps({"choice": ["no"]}))  # outputs that left the guide may only end
    assert np.flatnonzero(off.mask(9, [0]).as_mask(size)).tolist() == [0]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=16)


def test_a_random_model_writes_only_what_the_guide_takes(llm):
    """The tiny model's weights are random: only the mask keeps its output in the schema."""
    params = SamplingParams(temperature=1.0, seed=11, n=8, max_tokens=200,
                            guided=json.dumps({"json_schema": SCHEMA}))
    [out] = llm.generate([[1, 2, 3, 4]], params)
    finished = [c for c in out.choices if c.finish_reason == "stop"]
    assert len(finished) >= 6, [c.finish_reason for c in out.choices]
    for choice in finished:
        assert conforms(json.loads(choice.text)), choice.text
    for choice in out.choices:  # even cut short, a prefix of an instance
        guide = compile_guide({"json_schema": SCHEMA})
        assert guide.advance_bytes(guide.initial(), choice.text.encode()) is not None


def test_greedy_json_object_and_choice_offline(llm):
    outs = llm.generate([[7, 8, 9], [10, 11]], [
        SamplingParams(temperature=0.0, max_tokens=200, guided=json.dumps({"json_object": True})),
        SamplingParams(temperature=0.0, max_tokens=20, guided=json.dumps({"choice": ["red", "green", "blue"]})),
    ])
    text = outs[0].choices[0].text
    guide = compile_guide({"json_object": True})
    assert guide.advance_bytes(guide.initial(), text.encode()) is not None
    if outs[0].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert outs[1].choices[0].text in ("red", "green", "blue") and outs[1].choices[0].finish_reason == "stop"


def test_offline_refuses_guides_it_cannot_follow(llm):
    with pytest.raises(ValueError, match="guided cannot be followed: schema: the keyword 'pattern' is not supported"):
        llm.generate([[1, 2]], SamplingParams(guided=json.dumps({"json_schema": {"type": "string", "pattern": "a"}})))
    with pytest.raises(ValueError, match="guided is not supported with use_beam_search"):
        llm.generate([[1, 2]], SamplingParams(n=2, use_beam_search=True, temperature=0.0,
                                              guided=json.dumps({"json_object": True})))
    assert not llm.engine.has_work()
    with pytest.raises(ValueError, match="'pattern' is not supported"):  # add_request alone checks too
        llm.add_request([1, 2], SamplingParams(guided=json.dumps({"json_schema": {"pattern": "a"}})))
    with pytest.raises(ValueError, match="guided is not supported with use_beam_search"):
        llm.add_request([1, 2], SamplingParams(n=2, use_beam_search=True, temperature=0.0,
                                               guided=json.dumps({"choice": ["yes"]})))
    assert not llm.engine.has_work()
    [out] = llm.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=8, guided=json.dumps({"choice": ["ok"]})))
    assert out.choices[0].text == "ok"  # the engine goes on


@pytest.mark.slow  # loads two tokenizers' vocabularies
def test_the_executor_reads_the_models_tokenizer_or_the_one_named(tiny_model_dir, tokenizer, tmp_path):
    from services.executor.vocabulary import load_vocabulary
    from shared.model_source import resolve_model

    source = resolve_model(str(tiny_model_dir))
    vocab = load_vocabulary(None, source, len(tokenizer) + 2)
    assert vocab.size == len(tokenizer) + 2 and vocab.pieces == token_bytes(tokenizer, len(tokenizer) + 2)
    tokenizer.save_pretrained(tmp_path)
    assert load_vocabulary(str(tmp_path), source, len(tokenizer)).pieces == vocab.pieces[:-2]
    with pytest.raises(ValueError, match="--tokenizer"):
        load_vocabulary(str(tmp_path / "missing"), source, 10)


def test_masks_are_kept_per_state_and_guides_per_spec(tokenizer, vocabulary):
    from services.executor import guided as module

    sampler = Sampler()
    sampler.guided.load_vocabulary = lambda: vocabulary
    specs = [json.dumps({"choice": [f"c{i}"]}) for i in range(module.GUIDES_KEPT + 1)]
    for seq_id, spec in enumerate(specs):
        params = SamplingParams(guided=spec, eos_token_ids=[0])
        sampler.add(seq_id, params)
        sampler.histories.add(sequence(seq_id, [1], [], params))
        first = sampler.guided.mask(seq_id, [0])
        assert sampler.guided.mask(seq_id, [0]) is first  # the second time from the cache
    assert len(sampler.guided._guides) == module.GUIDES_KEPT and specs[0] not in sampler.guided._guides
    assert tokenizer.decode(sampler.guided.mask(0, [0]).ids[:1].tolist()) == "c"  # still guided


def test_an_executor_that_cannot_guide_fails_the_guided_requests_alone(tiny_model_dir):
    from shared.messages import AddRequest

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    loads = []

    def broken():
        loads.append(1)
        raise ValueError("--tokenizer /nowhere: cannot load the tokenizer")

    llm.engine.runner.sampler.guided.load_vocabulary = broken
    guides = [json.dumps({"choice": ["a"]}), json.dumps({"json_object": True})]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              *(SamplingParams(temperature=0.0, max_tokens=6, guided=g, eos_token_ids=[0]) for g in guides)]
    for i, p in enumerate(params):
        llm.engine.add_request(AddRequest(f"r{i}", np.asarray([1, 2, 3], np.int32), p, 0.0))
    outputs: dict[str, list] = {}
    while llm.engine.has_work():
        for out in llm.engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert [o.finish_reason for o in outputs["r0"]][-1] == "length"
    assert sum(len(o.new_token_ids) for o in outputs["r0"]) == 6
    for failed in ("r1", "r2"):
        last = outputs[failed][-1]
        assert last.finish_reason == "error" and "cannot load the tokenizer" in last.error
        assert last.error_kind == "engine"
    assert len(loads) == 1  # the failure is kept, not retried every step
    assert llm.engine.blocks.num_used_blocks == 0


def test_added_tokens_are_their_text(tmp_path):
    tokenizer = cached_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    grown = AutoTokenizer.from_pretrained(tmp_path)
    grown.add_tokens(["café", "<tool>"])
    pieces = token_bytes(grown, len(grown))
    for text in ("café", "<tool>"):  # as the detokenizer writes them ("caf" and a replacement character)
        token_id = grown.convert_tokens_to_ids(text)
        assert pieces[token_id] == grown.decode([token_id]).encode()
    assert pieces[grown.convert_tokens_to_ids("<tool>")] == b"<tool>"


@pytest.mark.parametrize("bounds", [{"minLength": 2, "maxLength": 5}, {"maxLength": 1},
                                    pytest.param({"minLength": 3}, marks=pytest.mark.slow)])  # slow: the longest walk
def test_bounded_strings_masks_made_from_the_unbounded_one_equal_checking_every_token(tokenizer, vocabulary, bounds):
    schema = {"type": "object", "properties": {"s": {"type": "string", **bounds}, "n": {"type": "integer"}},
              "required": ["s", "n"]}
    spec = json.dumps({"json_schema": schema})
    guide = compile_guide(spec)
    sequences = GuidedSequences(TokenHistories(), lambda: vocabulary)
    prefixes = ['{"s": "', '{"s": "a', '{"s": "ab', '{"s": "é\\n', '{"s": "abcd', '{"s": "\\ud83d\\ude00',
                '{"s": "abcde']
    for seq_id, prefix in enumerate(prefixes):
        outputs = tokenizer.encode(prefix, add_special_tokens=False)
        state = guide.advance_bytes(guide.initial(), b"".join(vocabulary.pieces[t] for t in outputs))
        if state is None:  # past the bound: not a state this guide reaches
            continue
        sequences.histories.add(sequence(seq_id, [1], outputs, SamplingParams()))
        sequences.add(seq_id, spec)
        assert guide.bounded_string(state) is not None
        made = sequences.mask(seq_id, []).as_mask(vocabulary.size)
        assert (made == brute_force(guide, state, vocabulary.pieces)).all(), prefix
