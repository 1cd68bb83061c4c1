"""The one rulebook for generation parameters (``shared.messages.sampling_rules``): every rule, through
the rulebook itself, the offline ``LLM`` (which raises it) and the HTTP frontend (a 400 naming the
JSON field the client sent), with the same reason."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from services.offline import LLM
from shared.messages import SamplingParams
from shared.messages.sampling_rules import (
    BEAM_ONLY, BEAM_REFUSED, RANGES, SamplingParamsError, guide_error, verify,
)
from tests.doubles.engine import tiny_llama
from tests.doubles.http import http

BEAM = {"use_beam_search": True, "n": 2}
BAD_SCHEMA = {"type": "string", "format": "colour"}  # a format llguidance does not know
ROUTES = {"completions": ("/v1/completions", {"prompt": "hi"}),
          "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})}


@dataclass(frozen=True)
class Case:
    """A bad parameter set: as ``SamplingParams`` fields (``params``) and as a JSON body on ``route``
    (``body``); the rulebook names ``field`` with ``reason``, HTTP names ``param``. ``renames``: the
    JSON names of the other fields the reason mentions, where the body used others."""

    id: str
    params: dict
    field: str
    reason: str
    body: dict
    param: str
    route: str = "completions"
    renames: dict = field(default_factory=dict)


def _case(id, params, field_, reason, body=None, param=None, **more) -> Case:
    return Case(id, params, field_, reason, params if body is None else body, param or field_, **more)


CASES = [
    _case("n-low", {"n": 0}, "n", "must be between 1 and 128, got 0"),
    _case("n-high", {"n": 129}, "n", "must be between 1 and 128, got 129"),
    _case("best_of-high", {"best_of": 129}, "best_of", "must be between 1 and 128, got 129"),
    _case("best_of-below-n", {"n": 3, "best_of": 2}, "best_of",
          "must be greater than or equal to n, got best_of=2 and n=3"),
    _case("temperature", {"temperature": 2.5}, "temperature", "must be between 0 and 2, got 2.5"),
    _case("top_p", {"top_p": 0.0}, "top_p", "must be in (0, 1], got 0.0"),
    _case("top_k", {"top_k": -2}, "top_k", "must be -1 or 0 (off) or a positive integer, got -2"),
    _case("min_p", {"min_p": 1.5}, "min_p", "must be between 0 and 1, got 1.5"),
    _case("presence_penalty", {"presence_penalty": -2.5}, "presence_penalty", "must be between -2 and 2, got -2.5"),
    _case("frequency_penalty", {"frequency_penalty": 2.5}, "frequency_penalty",
          "must be between -2 and 2, got 2.5"),
    _case("repetition_penalty", {"repetition_penalty": 0.0}, "repetition_penalty", "must be in (0, 2], got 0.0"),
    _case("seed", {"seed": 2**64}, "seed", f"must fit in 64 bits, got {2**64}"),
    _case("max_tokens", {"max_tokens": -1}, "max_tokens", "must be at least 1, got -1"),
    _case("max_completion_tokens", {"max_tokens": -1}, "max_tokens", "must be at least 1, got -1",
          {"max_completion_tokens": -1}, "max_completion_tokens", route="chat"),
    _case("min_tokens", {"min_tokens": -1}, "min_tokens", "must be at least 0, got -1"),
    _case("min_tokens-above-max", {"max_tokens": 3, "min_tokens": 5}, "min_tokens",
          "must not exceed max_tokens (3), got 5"),
    _case("min_tokens-above-max_completion_tokens", {"max_tokens": 3, "min_tokens": 5}, "min_tokens",
          "must not exceed max_tokens (3), got 5", {"max_completion_tokens": 3, "min_tokens": 5}, route="chat",
          renames={"max_tokens": "max_completion_tokens"}),
    _case("min_tokens-above-the-default", {"max_tokens": 16, "min_tokens": 17}, "min_tokens",
          "must not exceed max_tokens (16), got 17", {"min_tokens": 17}),  # completions' default max_tokens
    _case("logprobs", {"logprobs": 21}, "logprobs", "must be between 0 and 20, got 21"),
    _case("top_logprobs", {"logprobs": 21}, "logprobs", "must be between 0 and 20, got 21",
          {"logprobs": True, "top_logprobs": 21}, "top_logprobs", route="chat"),
    _case("prompt_logprobs", {"prompt_logprobs": 21}, "prompt_logprobs", "must be between 0 and 20, got 21"),
    _case("length_penalty", {"length_penalty": 11.0}, "length_penalty", "must be between -10 and 10, got 11.0"),
    _case("early_stopping", {"early_stopping": "always"}, "early_stopping",
          "must be true, false or \"never\", got 'always'"),
    _case("logit_bias-value", {"logit_bias_token_ids": [5], "logit_bias_values": [150.0]}, "logit_bias_values",
          "must be between -100 and 100, got 150.0", {"logit_bias": {"5": 150}}, "logit_bias"),
    _case("logit_bias-id", {"logit_bias_token_ids": [-1], "logit_bias_values": [1.0]}, "logit_bias_token_ids",
          "token ids must be non-negative integers, got -1", {"logit_bias": {"-1": 1}}, "logit_bias"),
    _case("logit_bias-entries", {"logit_bias_token_ids": list(range(1025)), "logit_bias_values": [0.0] * 1025},
          "logit_bias_token_ids", "takes at most 1024 tokens, got 1025",
          {"logit_bias": {str(t): 0 for t in range(1025)}}, "logit_bias"),
    _case("stop_token_ids", {"stop_token_ids": [-1]}, "stop_token_ids",
          "must be a list of non-negative integer token ids"),
    _case("beam-temperature", {**BEAM, "temperature": 0.5}, "temperature", "must be 0 with use_beam_search, got 0.5"),
    _case("beam-best_of", {**BEAM, "temperature": 0.0, "best_of": 4}, "best_of",
          "must equal n (the beam width) with use_beam_search, got best_of=4 and n=2", {**BEAM, "best_of": 4}),
    *(_case(f"beam-{name}", {**BEAM, "temperature": 0.0, name: value}, name, "is not supported with use_beam_search",
            {**BEAM, name: value}) for name, value in (
        ("top_p", 0.5), ("top_k", 5), ("min_p", 0.1), ("presence_penalty", 0.5), ("frequency_penalty", 0.5),
        ("repetition_penalty", 1.2), ("min_tokens", 2), ("stop_token_ids", [3]), ("logprobs", 2),
        ("prompt_logprobs", 1))),
    _case("beam-chat-logprobs", {**BEAM, "temperature": 0.0, "logprobs": 0}, "logprobs",
          "is not supported with use_beam_search", {**BEAM, "logprobs": True}, route="chat"),
    _case("beam-logit_bias", {**BEAM, "temperature": 0.0, "logit_bias_token_ids": [5], "logit_bias_values": [1.0]},
          "logit_bias_token_ids", "is not supported with use_beam_search", {**BEAM, "logit_bias": {"5": 1}},
          "logit_bias"),
    _case("beam-guided", {**BEAM, "temperature": 0.0, "guided": json.dumps({"json_object": True})}, "guided",
          "is not supported with use_beam_search", {**BEAM, "response_format": {"type": "json_object"}},
          "response_format"),
    _case("beam-guided_choice", {**BEAM, "temperature": 0.0, "guided": json.dumps({"choice": ["a", "b"]})},
          "guided", "is not supported with use_beam_search", {**BEAM, "guided_choice": ["a", "b"]},
          "guided_choice", route="chat"),
    _case("length_penalty-without-beam", {"length_penalty": 2.0}, "length_penalty",
          "applies only with use_beam_search; got 2.0 without it"),
    _case("early_stopping-without-beam", {"early_stopping": True}, "early_stopping",
          "applies only with use_beam_search; got True without it"),
    _case("guided", {"guided": json.dumps({"json_schema": BAD_SCHEMA})}, "guided",
          f"cannot be followed: {guide_error(json.dumps({'json_schema': BAD_SCHEMA}))}",
          {"guided_json": BAD_SCHEMA}, "guided_json"),
]


@pytest.fixture(scope="module")
def llm():
    return LLM.from_hf_model(tiny_llama(seed=31), dtype=torch.float32, num_kv_blocks=16, block_size=4)


def _http_message(case: Case, error: SamplingParamsError) -> str:
    """What the frontend answers: the JSON field, then the rulebook's reason in the body's names.
    A guide the engine cannot follow is refused as it is read, at its place in the field, with
    ``compile_guide``'s words (the reason's own)."""
    if case.field == "guided" and "cannot be followed" in case.reason:
        return f"{case.param}: {guide_error(case.params['guided'])}"
    return f"{case.param} {error.worded(lambda name: case.renames.get(name, name))}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_rulebook_llm_and_http_refuse_alike(case, llm, frontend, model):
    with pytest.raises(SamplingParamsError) as info:
        verify(SamplingParams(**case.params))
    error = info.value
    assert (error.field, error.reason, str(error)) == (case.field, case.reason, f"{case.field} {case.reason}")
    assert isinstance(error, ValueError)

    with pytest.raises(SamplingParamsError) as offline:
        llm.generate([[1, 2, 3]], SamplingParams(**case.params))
    assert (offline.value.field, offline.value.reason) == (case.field, case.reason)
    assert not llm.engine.has_work()

    path, base = ROUTES[case.route]
    status, _, raw = http("POST", frontend.base_url + path, body={"model": model.name, **base, **case.body})
    answer = json.loads(raw)["error"]
    assert status == 400 and (answer["param"], answer["type"]) == (case.param, "invalid_request_error"), answer
    assert answer["message"] == _http_message(case, error), answer


def test_every_rule_has_a_case():
    refused_fields = {c.field for c in CASES if c.reason == "is not supported with use_beam_search"}
    only_fields = {c.field for c in CASES if c.reason.startswith("applies only with use_beam_search")}
    ranged = {c.field for c in CASES
              if c.reason.startswith("must") and c.reason.endswith(f"got {c.params.get(c.field)}")}
    assert set(RANGES) <= ranged, set(RANGES) - ranged
    assert set(BEAM_REFUSED) == refused_fields and set(BEAM_ONLY) == only_fields


def test_what_only_llm_can_send_is_refused_too(llm):
    """Shapes the JSON readers cannot produce: the rulebook still names them."""
    for params, field_, fragment in (
        ({"logit_bias_token_ids": [1, 2], "logit_bias_values": [1.0]}, "logit_bias_values", "one bias per token id"),
        ({"temperature": float("nan")}, "temperature", "must be a finite number"),
        ({"n": 2.0}, "n", "must be an integer"),
        ({"early_stopping": 1}, "early_stopping", 'must be true, false or "never"'),
        ({"guided": {"choice": ["a"]}}, "guided", "not a spec's JSON text"),
        ({"use_beam_search": True, "n": 2}, "temperature", "must be 0 with use_beam_search, got 1.0"),
    ):
        with pytest.raises(SamplingParamsError) as info:
            llm.generate([[1, 2]], SamplingParams(**params))
        assert info.value.field == field_ and fragment in info.value.reason, info.value


def test_what_the_rules_allow_passes_through_both(llm, frontend, model):
    for params in ({}, {"max_tokens": 0, "prompt_logprobs": 1}, {"top_k": -1}, {"n": 2, "best_of": 3},
                   {**BEAM, "temperature": 0.0, "best_of": 2, "length_penalty": 0.5, "early_stopping": "never"}):
        verify(SamplingParams(**params))
    [out] = llm.generate([[1, 2, 3]], SamplingParams(**BEAM, temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(out.choices) == 2 and all(len(c.token_ids) == 2 for c in out.choices)
    path, base = ROUTES["completions"]
    status, _, raw = http("POST", frontend.base_url + path,
                          body={"model": model.name, **base, **BEAM, "max_tokens": 3})
    assert status == 200, raw
