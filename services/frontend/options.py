"""The generation fields of /v1/completions and /v1/chat/completions, each declared once.

``GenerationOptions`` is the one place a sampling, stopping, logprobs or streaming field is
written: its type, range, default, routes, aliases, description, what beam search makes of it and
how it reaches ``SamplingParams``. Parsing, the 400s, /openapi.json and the conversion to
``SamplingParams`` are derived from it (``fields``). The ranges are the rulebook's
(``shared.messages.sampling_rules.RANGES``, which the offline ``LLM`` checks too), read here so
that a value out of range is refused as it is read, in the rulebook's words; the rulebook's
cross-field rules run on the ``SamplingParams`` built (``preprocess``), and the rules only a
request's JSON can break are in ``request_rules``. Token ids are checked against the vocabulary
later, in ``preprocess``, which knows the model.

Several choices per prompt: ``n`` (1 to ``MAX_N``) samples, or ``best_of`` (``n`` to ``MAX_N``)
samples of which the ``n`` with the highest cumulative log-probability are returned (OpenAI's
completions field; accepted on chat too, as vLLM does), or vLLM's beam search (``use_beam_search``,
beam width ``n``, ``length_penalty``, ``early_stopping``). Beam search scores candidates by the
model's raw log-probabilities, greedily, so the rulebook refuses the fields it would ignore with it
rather than silently dropping them, and the fields only it uses without it.

Structured outputs (``guides``): OpenAI's ``response_format`` and vLLM's ``guided_json`` and
``guided_choice``, one per request, each read into a guide spec that reaches ``SamplingParams.guided``;
chat's tools (``tools``) may set the guide instead (``tool_guide``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.frontend.errors import bad_request, describe, is_int, json_type
from services.frontend.field_kinds import Boolean, Custom, Integer, Number
from services.frontend.fields import Route, declare, declared_fields
from services.frontend.guides import (
    GUIDED_CHOICE, GUIDED_GRAMMAR, GUIDED_JSON, GUIDED_REGEX, RESPONSE_FORMAT, STRUCTURED_OUTPUTS, guided_text,
)
from shared.messages.sampling_rules import (
    LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, RANGES, TOKEN_IDS_RULE, Range,
    early_stopping_reason, logit_bias_id_reason,
)

MAX_STOP_STRINGS = 4

_COMPLETIONS, _CHAT = Route.COMPLETIONS, Route.CHAT


def _ranged(name: str) -> Integer | Number:
    """The kind of a field whose range is the rulebook's (``shared.messages.sampling_rules``)."""
    r: Range = RANGES[name]
    if r.integer:
        return Integer(int(r.low), None if r.high is None else int(r.high), r.rule)
    return Number(r.low, r.high, exclusive_minimum=r.exclusive_low)


# ---------------------------------------------------------------- values with a shape of their own


def _read_logit_bias(name: str, value: Any) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` with biases in [-100, 100]."""
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object mapping token ids to numbers, got {json_type(value)}", name)
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"{name} takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(value)}", name)
    bias: dict[int, float] = {}
    for key, number in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"{name} keys must be token ids (integers), got {key!r}", name) from None
        if token_id < 0:
            raise bad_request(f"{name} {logit_bias_id_reason(token_id)}", name)
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise bad_request(f"{name}[{key!r}] must be a number between -{MAX_LOGIT_BIAS} and {MAX_LOGIT_BIAS}, "
                              f"got {describe(number)}", name)
        if (reason := LOGIT_BIAS_RANGE.reason(float(number))) is not None:
            raise bad_request(f"{name} {reason}", name)
        bias[token_id] = bias.get(token_id, 0.0) + float(number)  # "5" and "05" name one token
    return bias


def _read_stop(name: str, value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"{name} must be a string or a list of strings, got {json_type(value)}", name)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"{name} takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", name)
    if any(not s for s in stops):
        raise bad_request(f"{name} strings must not be empty", name)
    return list(dict.fromkeys(stops))


def _read_token_ids(name: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value):
        raise bad_request(f"{name} {TOKEN_IDS_RULE}", name)
    return list(value)


def _read_include_usage(name: str, value: Any) -> bool:
    """``stream_options``: only ``include_usage`` means anything to us."""
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object, got {json_type(value)}", name)
    include = value.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise bad_request(f"{name}.include_usage must be a boolean, got {json_type(include)}", f"{name}.include_usage")
    return bool(include)


def _read_early_stopping(name: str, value: Any) -> bool | str:
    if isinstance(value, bool) or value == "never":
        return value
    raise bad_request(f"{name} {early_stopping_reason(value)}", name)


def _positive_or_off(top_k: int) -> int | None:
    return top_k if top_k > 0 else None


def _logit_bias_lists(bias: dict[int, float], options: Any) -> dict[str, Any]:
    return {"logit_bias_token_ids": list(bias), "logit_bias_values": list(bias.values())}


def _held_back_samples(best_of: int | None, options: Any) -> dict[str, Any]:
    """``best_of`` equal to ``n`` holds nothing back: the engine runs it as plain ``n`` (one below
    ``n`` reaches the rulebook, which refuses it)."""
    return {"best_of": None if best_of == options.n else best_of}


_TOKEN_ID_LIST = {"type": "array", "items": {"type": "integer", "minimum": 0}}
LOGIT_BIAS = Custom(_read_logit_bias, {
    "type": "object",
    "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS},
    "propertyNames": {"pattern": "^[0-9]+$"},
})
STOP = Custom(_read_stop, {"oneOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
]})
TOKEN_IDS = Custom(_read_token_ids, _TOKEN_ID_LIST)
STREAM_OPTIONS = Custom(_read_include_usage, {"type": "object", "properties": {"include_usage": {"type": "boolean"}}})
EARLY_STOPPING_KIND = Custom(_read_early_stopping, {"oneOf": [{"type": "boolean"}, {"const": "never"}]},
                             has_default=True)
NUM_LOGPROBS = _ranged("logprobs")


# ---------------------------------------------------------------- the declaration


@dataclass
class GenerationOptions:
    """The generation fields of a request, parsed; a field left out keeps its default. ``logprobs``
    is ``None`` (off) or how many most likely tokens to list with each token (0: only its own);
    chat's ``logprobs`` / ``top_logprobs`` pair is settled into it by ``request_rules``. ``given``
    maps each attribute the body set to the JSON name it came under."""

    max_tokens: int | None = declare(
        Integer(minimum=1), route_kinds={_COMPLETIONS: _ranged("max_tokens")}, nullable=True,
        aliases=("max_completion_tokens",), alias_routes=_CHAT,
        description="Most tokens to generate; left out: 16 on completions, the context left on chat (or the "
                    "model's recommended length, --generation-config). 0 only on completions with echo (the prompt "
                    "alone, for scoring).")
    temperature: float = declare(_ranged("temperature"), 1.0, sampling=True)
    top_p: float = declare(_ranged("top_p"), 1.0, sampling=True)
    top_k: int | None = declare(
        _ranged("top_k"), convert=_positive_or_off, sampling=True, description="-1 or 0: off.")
    min_p: float = declare(_ranged("min_p"), 0.0, sampling=True)
    presence_penalty: float = declare(_ranged("presence_penalty"), 0.0, sampling=True)
    frequency_penalty: float = declare(_ranged("frequency_penalty"), 0.0, sampling=True)
    repetition_penalty: float = declare(_ranged("repetition_penalty"), 1.0, sampling=True)
    logit_bias: dict[int, float] = declare(
        LOGIT_BIAS, factory=dict, sampling=_logit_bias_lists,
        description="Token id (as a string) -> bias added to its logit.")
    seed: int | None = declare(_ranged("seed"), sampling=True)
    min_tokens: int = declare(_ranged("min_tokens"), 0, sampling=True)
    ignore_eos: bool = declare(Boolean(), False, sampling=True)
    stop_token_ids: list[int] = declare(TOKEN_IDS, factory=list, sampling=True)
    stop: list[str] = declare(STOP, factory=list)
    stream: bool = declare(Boolean(), False)
    include_usage: bool = declare(STREAM_OPTIONS, False, json_name="stream_options", requires="stream",
                                  description="Only with stream: a last chunk carries the usage.")
    n: int = declare(_ranged("n"), 1, sampling=True,
                     description="Choices per prompt (beam width with use_beam_search).")
    best_of: int | None = declare(
        _ranged("best_of"), sampling=_held_back_samples,
        description="Sample this many (at least n) and return the n most likely; not with stream unless equal to n.")
    use_beam_search: bool = declare(
        Boolean(), False, sampling=True,
        description="vLLM's beam search of width n: temperature must be 0 or left out; sampling and penalty "
                    "fields, logit_bias, min_tokens, stop_token_ids, logprobs and structured outputs are refused "
                    "with it. Streamed, each hypothesis comes as one chunk when the search ends.")
    length_penalty: float = declare(
        _ranged("length_penalty"), 1.0, sampling=True,
        description="Beam search only: scores are divided by length ** this.")
    early_stopping: bool | str = declare(EARLY_STOPPING_KIND, False, sampling=True,
                                         description="Beam search only, as in transformers.")
    logprobs: int | None = declare(NUM_LOGPROBS, nullable=True, routes=_COMPLETIONS, sampling=True)
    top_logprobs: int | None = declare(NUM_LOGPROBS, routes=_CHAT, description="Only with logprobs true.")
    chat_logprobs: bool = declare(Boolean(), False, json_name="logprobs", routes=_CHAT)
    prompt_logprobs: int | None = declare(
        _ranged("prompt_logprobs"), nullable=True, sampling=True,
        description="vLLM's extension: the logprob of every prompt token after the first and of the k most "
                    "likely tokens at its position, in the response's prompt_logprobs (per choice on "
                    "completions, once on chat). Not with stream.")
    response_format: dict[str, Any] | None = declare(
        RESPONSE_FORMAT, sampling=guided_text,
        description='OpenAI\'s structured outputs: {"type": "text"} (free text, the default), {"type": '
                    '"json_object"} (any JSON object) or {"type": "json_schema", "json_schema": {"name": ..., '
                    '"schema": {...}}} (a value valid against the schema). Decoding is constrained token by token; '
                    'a schema keyword that is not supported is a 400. One guide per request; not with beam search.')
    guided_json: dict[str, Any] | None = declare(
        GUIDED_JSON,
        description="vLLM's extension: a JSON schema (or its text) the output must be valid against.")
    guided_choice: dict[str, Any] | None = declare(
        GUIDED_CHOICE, description="vLLM's extension: the output is exactly one of these.")
    guided_regex: dict[str, Any] | None = declare(
        GUIDED_REGEX, description="vLLM's extension: the output matches this regex whole (Rust regex syntax).")
    guided_grammar: dict[str, Any] | None = declare(
        GUIDED_GRAMMAR, description="vLLM's extension: the output is a sentence of this context-free grammar "
                                    "(GBNF as llama.cpp writes it, or Lark).")
    structured_outputs: dict[str, Any] | None = declare(
        STRUCTURED_OUTPUTS,
        description="vLLM's newer form of the guides: one of json (a schema or its text), choice, regex, grammar "
                    "or json_object: true; disable_any_whitespace: true writes the JSON compact. structural_tag "
                    "and whitespace_pattern are refused.")
    given: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    # chat's tools: the guide a named or "required" tool_choice sets (``tools.settle_tool_choice``),
    # never read from the body; it reaches ``SamplingParams.guided`` as the guide fields do
    tool_guide: dict[str, Any] | None = field(default=None, repr=False)

    def param(self, attr: str) -> str:
        """The JSON name field ``attr`` came under (its own name when the body left it out)."""
        if attr in self.given:
            return self.given[attr]
        return next(d.name for d in declared_fields(GenerationOptions) if d.attr == attr)

    @property
    def max_tokens_param(self) -> str:
        return self.param("max_tokens")
