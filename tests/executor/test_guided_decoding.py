"""Guided decoding on the executor (``services/executor/guided.py``: an llguidance matcher per
sequence): the masks equal a token-by-token check by a regex engine no one here wrote (the
``regex`` package's partial matches), the sampler keeps guided rows inside their guide, and the
offline engine's output on a random model (which goes everywhere the mask lets it, mid-UTF-8
tokens included) is always what the guide says: ``re.fullmatch`` for a regex, Python's ``ast`` for
a GBNF grammar, ``jsonschema`` (formats checked) for a JSON schema."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import numpy as np
import pytest
import regex
import torch

from services.executor.guided import GuidedSequences, vocabulary_of
from services.executor.histories import TokenHistories
from services.executor.sampler import Sampler
from services.offline import LLM
from shared.messages import NewSequence, SamplingParams
from tests.doubles.fake_scheduler import cached_tokenizer
from tests.shared.test_structured_guide import live

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": -999, "maximum": 999},
        "tag": {"enum": ["x", "yz", 7]},
        "s": {"type": "string", "maxLength": 4, "pattern": "^[a-z€]*$"},
        "day": {"type": "string", "format": "date"},
    },
    "required": ["ok", "n"],
    "additionalProperties": False,
}
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA, format_checker=jsonschema.FormatChecker())
# non-ASCII characters, so that a random model's tokens split them (byte-level BPE's byte tokens)
REGEX = r"[a-c]{1,3}-(é|€|😀|ü){1,4}\.[0-9]{2}"
# GBNF arithmetic, bounded so that a random walk ends (``test_structured_guide.ARITHMETIC`` recurses)
SHORT_ARITHMETIC = r'''
root   ::= term (("+" | "-") term){0,2}
term   ::= factor (("*" | "/") factor)?
factor ::= "0" | [1-9] [0-9]{0,2} | "(" [1-9] ("+" [0-9])? ")"
'''


def conforms(value) -> bool:
    """``value`` is an instance of SCHEMA, as ``jsonschema`` (formats checked) says."""
    return VALIDATOR.is_valid(value)


@pytest.fixture(scope="module")
def tokenizer():
    return cached_tokenizer()


@pytest.fixture(scope="module")
def vocabulary(tokenizer):
    return vocabulary_of(tokenizer, len(tokenizer))


def _texts(vocabulary, size: int) -> list[str | None]:
    """Each id's text, None for special tokens and bytes that are not whole UTF-8 characters."""
    out: list[str | None] = []
    for token in range(size):
        try:
            out.append(None if vocabulary.is_special_token(token) else vocabulary.decode_bytes([token]).decode())
        except UnicodeDecodeError:
            out.append(None)
    return out


def test_regex_masks_equal_checking_every_token_with_partial_matches(tokenizer, vocabulary):
    pattern = r"(yes|no)-[0-9]{2,4}(ab|c)?!"
    texts = _texts(vocabulary, len(tokenizer))
    for seq_id, prefix in enumerate(["", "y", "no-", "no-1", "yes-12", "yes-1234", "no-99c", "no-99c!"]):
        histories = TokenHistories()
        histories.add(sequence(seq_id, [1], tokenizer.encode(prefix, add_special_tokens=False), SamplingParams()))
        guided = GuidedSequences(histories, lambda: vocabulary)
        guided.add(seq_id, json.dumps({"regex": pattern}))
        mask = guided.mask(seq_id, []).as_mask(len(tokenizer))
        expected = np.array([t is not None and t != "" and regex.fullmatch(pattern, prefix + t, partial=True)
                             is not None for t in texts])
        assert not (mask & ~expected).any(), prefix  # every token allowed keeps the text a prefix of a match
        if prefix == "y":  # the next bytes are forced ("es-"): llguidance allows the tokens that write
            assert mask.any()  # them as the tokenizer would (here "es", not "e")
        else:  # and otherwise every such token
            assert (mask == expected).all(), (prefix, np.flatnonzero(mask != expected)[:5])
        assert mask.any() == (prefix != "no-99c!")


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


@pytest.mark.parametrize("density", [0.0, 0.0005, 0.3, 0.9995, 1.0])
def test_token_sets_read_from_a_bitmask_equal_numpys_unpacking(density):
    from services.executor.guided import token_set

    size = 1000  # not a multiple of 32: the last word's spare bits are never ids
    rng = np.random.default_rng(int(density * 1e4))
    allowed = rng.random(size) < density
    words = np.packbits(np.concatenate([allowed, np.zeros(24, bool)]), bitorder="little").view(np.uint32)
    tokens = token_set(words.copy(), size)
    assert (tokens.as_mask(size) == allowed).all() and (tokens.ids < size).all()
    assert tokens.keep == (allowed.sum() <= size // 2) or 0.2 < density < 0.8


def test_a_sequence_state_follows_its_history_through_a_restart(tokenizer, vocabulary):
    sampler = Sampler()
    sampler.guided.load_vocabulary = lambda: vocabulary
    params = SamplingParams(guided=json.dumps({"json_schema": SCHEMA}), eos_token_ids=[tokenizer.eos_token_id])
    outputs = tokenizer.encode('{"ok": true, "n": 1', add_special_tokens=False)
    sampler.add(9, params)
    sampler.histories.add(sequence(9, [1, 2], outputs, params))
    size = len(tokenizer)
    before = sampler.guided.mask(9, params.eos_token_ids).as_mask(size)
    fresh = GuidedSequences(sampler.histories, lambda: vocabulary)  # a new executor: only the history
    fresh.add(9, params.guided)
    after = fresh.mask(9, params.eos_token_ids).as_mask(size)
    assert (before == after).all()
    digits = [tokenizer.decode([i]) for i in np.flatnonzero(after)]
    assert "2" in digits and "}" in digits and "," in digits and '"' not in digits
    shorter = outputs[:-2]  # a history that got shorter (a recompute): the matcher starts again
    sampler.histories.add(sequence(9, [1, 2], shorter, params))
    fresh_shorter = GuidedSequences(sampler.histories, lambda: vocabulary)
    fresh_shorter.add(9, params.guided)
    assert (sampler.guided.mask(9, params.eos_token_ids).as_mask(size)
            == fresh_shorter.mask(9, params.eos_token_ids).as_mask(size)).all()
    sampler.histories.add(sequence(9, [1, 2], outputs, params))
    off = GuidedSequences(sampler.histories, lambda: vocabulary)
    off.add(9, json.dumps({"choice": ["no"]}))  # outputs that left the guide may only end
    assert np.flatnonzero(off.mask(9, [0]).as_mask(size)).tolist() == [0]


def test_outputs_from_elsewhere_may_only_end_and_a_bad_spec_fails_its_sequence(tokenizer, vocabulary):
    from services.executor.guided import GuideUnavailable

    histories = TokenHistories()
    guided = GuidedSequences(histories, lambda: vocabulary)
    histories.add(sequence(1, [1], [len(tokenizer) + 5], SamplingParams()))  # an id past the vocabulary
    guided.add(1, json.dumps({"regex": "[a-z]+"}))
    assert guided.mask(1, [0, 2]).as_mask(len(tokenizer)).nonzero()[0].tolist() == [0, 2]
    histories.add(sequence(2, [1], [], SamplingParams()))
    guided.add(2, json.dumps({"regex": "a[0-9"}))  # never from the frontend, which refuses it
    with pytest.raises(GuideUnavailable, match="unclosed character class"):
        guided.mask(2, [0])


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, block_size=16)


def test_a_random_model_writes_only_what_the_guide_takes(llm):
    """The tiny model's weights are random: only the mask keeps its output in the guide."""
    guides = [{"json_schema": SCHEMA}, {"regex": REGEX}, {"grammar": SHORT_ARITHMETIC}]
    params = [SamplingParams(temperature=1.0, seed=11 + i, n=6, max_tokens=120, guided=json.dumps(g))
              for i, g in enumerate(guides)]
    outs = llm.generate([[1, 2, 3, 4]] * len(guides), params)
    accepts = [lambda text: conforms(json.loads(text)), lambda text: re.fullmatch(REGEX, text) is not None,
               lambda text: isinstance(ast.parse(text, mode="eval"), ast.Expression)]
    vocabulary = llm.engine.runner.sampler.guided.vocabulary
    split = 0  # tokens that are not whole UTF-8 characters on their own
    for guide, out, accept in zip(guides, outs, accepts):
        finished = [c for c in out.choices if c.finish_reason == "stop"]
        assert len(finished) >= 4, (guide, [c.finish_reason for c in out.choices])
        for choice in finished:
            assert accept(choice.text), (guide, choice.text)
        for choice in out.choices:  # even cut short, a prefix of a text the guide takes
            data = b"".join(vocabulary.decode_bytes([t]) for t in choice.token_ids)
            assert live_spec(guide, data), choice.text
            split += sum(not _whole_utf8(vocabulary.decode_bytes([t])) for t in choice.token_ids)
    assert split  # the regex's characters came in pieces too, and the mask took them


def live_spec(spec: dict, data: bytes) -> bool:
    from shared.structured import compile_guide

    return live(compile_guide(spec), data)


def _whole_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_greedy_json_object_and_choice_offline(llm):
    outs = llm.generate([[7, 8, 9], [10, 11]], [
        SamplingParams(temperature=0.0, max_tokens=200, guided=json.dumps({"json_object": True})),
        SamplingParams(temperature=0.0, max_tokens=20, guided=json.dumps({"choice": ["red", "green", "blue"]})),
    ])
    text = outs[0].choices[0].text
    assert live_spec({"json_object": True}, text.encode())
    if outs[0].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert outs[1].choices[0].text in ("red", "green", "blue") and outs[1].choices[0].finish_reason == "stop"


def test_offline_refuses_guides_it_cannot_follow(llm):
    with pytest.raises(ValueError, match="guided cannot be followed: .*unclosed character class"):
        llm.generate([[1, 2]], SamplingParams(guided=json.dumps({"regex": "a[0-9"})))
    with pytest.raises(ValueError, match="guided is not supported with use_beam_search"):
        llm.generate([[1, 2]], SamplingParams(n=2, use_beam_search=True, temperature=0.0,
                                              guided=json.dumps({"json_object": True})))
    assert not llm.engine.has_work()
    with pytest.raises(ValueError, match="Unknown format: colour"):  # add_request alone checks too
        llm.add_request([1, 2], SamplingParams(guided=json.dumps({"json_schema": {"format": "colour"}})))
    with pytest.raises(ValueError, match="guided is not supported with use_beam_search"):
        llm.add_request([1, 2], SamplingParams(n=2, use_beam_search=True, temperature=0.0,
                                               guided=json.dumps({"choice": ["yes"]})))
    assert not llm.engine.has_work()
    [out] = llm.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=8, guided=json.dumps({"choice": ["ok"]})))
    assert out.choices[0].text == "ok"  # the engine goes on


@pytest.mark.slow  # loads two tokenizers' vocabularies
def test_the_executor_reads_the_models_tokenizer_or_the_one_named(tiny_model_dir, tokenizer, tmp_path):
    from services.executor.guided import load_vocabulary
    from shared.model_source import resolve_model

    source = resolve_model(str(tiny_model_dir))
    vocab = load_vocabulary(None, source, len(tokenizer) + 2)
    assert vocab.vocab_size == len(tokenizer) + 2
    text = 'Héllo {"a": [1, 2]} € 😀'
    assert vocab.decode_bytes(tokenizer.encode(text, add_special_tokens=False)) == text.encode()
    tokenizer.save_pretrained(tmp_path)
    assert load_vocabulary(str(tmp_path), source, len(tokenizer)).vocab_size == len(tokenizer)
    with pytest.raises(ValueError, match="--tokenizer"):
        load_vocabulary(str(tmp_path / "missing"), source, 10)


def test_matchers_are_compiled_once_per_spec_and_kept_for_a_while(tokenizer, vocabulary):
    from services.executor import guided as module

    sampler = Sampler()
    sampler.guided.load_vocabulary = lambda: vocabulary
    specs = [json.dumps({"choice": [f"c{i}"]}) for i in range(module.GUIDES_KEPT + 1)]
    for seq_id, spec in enumerate(specs):
        params = SamplingParams(guided=spec, eos_token_ids=[0])
        sampler.add(seq_id, params)
        sampler.histories.add(sequence(seq_id, [1], [], params))
        first = sampler.guided.mask(seq_id, [0])
        assert (sampler.guided.mask(seq_id, [0]).as_mask(len(tokenizer)) == first.as_mask(len(tokenizer))).all()
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
