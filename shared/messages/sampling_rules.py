"""The one rulebook for generation parameters: the ranges and cross-field rules of ``SamplingParams``,
checked by ``verify`` for the HTTP frontend (which names the JSON field the client sent, in a 400)
and for the offline ``LLM`` (which raises) alike, as vLLM's ``SamplingParams._verify_args``.

- ranges (``RANGES``): n and best_of 1 to ``MAX_N``; temperature 0 to 2; top_p in (0, 1]; top_k
  None, -1 or 0 (off) or positive; min_p 0 to 1; presence and frequency penalties -2 to 2;
  repetition_penalty in (0, 2]; a seed that fits in 64 bits; max_tokens at least 1 (0: the prompt
  alone, scored with prompt_logprobs, nothing generated); min_tokens at least 0; logprobs and
  prompt_logprobs 0 to ``MAX_LOGPROBS``; length_penalty within +-``MAX_LENGTH_PENALTY``.
- logit_bias: at most ``MAX_LOGIT_BIAS_ENTRIES`` non-negative token ids, one bias each, each
  bias within +-100; stop_token_ids non-negative; early_stopping true, false or "never".
- min_tokens must not exceed max_tokens; best_of is at least n.
- beam search (width n): temperature 0, best_of equal to n (or None), and none of the fields it
  would ignore (``BEAM_REFUSED``: the sampling and penalty fields, logit_bias, min_tokens,
  stop_token_ids, logprobs, prompt_logprobs, guided); without it, none of the fields only it uses
  (``BEAM_ONLY``: length_penalty, early_stopping).
- guided: a spec ``shared.structured.compile_guide`` takes.

Each violation is one ``SamplingParamsError`` (a ``ValueError``) naming the ``SamplingParams``
field and the reason. What only a request's JSON can get wrong (types, unknown fields, stream with
best_of or prompt_logprobs, one guide field of several, stop strings) stays in the frontend.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

from shared.messages.requests import SamplingParams
from shared.structured import compile_guide

MAX_N = 128  # choices (n), samples (best_of) or beams per prompt, OpenAI's limit for n
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LENGTH_PENALTY = 10.0  # |length_penalty|: length ** penalty stays a finite, non-zero float
EARLY_STOPPING = (True, False, "never")
GUIDES_KEPT = 256  # verdicts on guide specs kept (clients send the same schema again and again)


class SamplingParamsError(ValueError):
    """One broken rule: ``field`` (a ``SamplingParams`` field) and ``reason`` ("must be ...").
    ``mentions``: the other fields the reason names, as ``{0}``, ``{1}``... in it, so that a caller
    can word them as its user wrote them (``worded``)."""

    def __init__(self, field: str, reason: str, mentions: tuple[str, ...] = ()) -> None:
        self.field = field
        self.mentions = mentions
        self._reason = reason
        super().__init__(f"{field} {self.reason}")

    @property
    def reason(self) -> str:
        return self.worded(str)

    def worded(self, name_of: Callable[[str], str]) -> str:
        """The reason with each mentioned field named by ``name_of``."""
        return self._reason.format(*map(name_of, self.mentions)) if self.mentions else self._reason


@dataclass(frozen=True)
class Range:
    """``[low, high]`` (``(low, high]`` with ``exclusive_low``; no ``high``: at least ``low``) of an
    integer or a finite number; ``rule`` words it where the bounds alone would not say it well."""

    low: float
    high: float | None = None
    exclusive_low: bool = False
    rule: str | None = None
    integer: bool = False

    @property
    def words(self) -> str:
        if self.rule is not None:
            return self.rule
        if self.high is None:
            return f"must be at least {self.low:g}"
        if self.exclusive_low:
            return f"must be in ({self.low:g}, {self.high:g}]"
        return f"must be between {self.low:g} and {self.high:g}"

    def holds(self, value: float) -> bool:
        above = value > self.low if self.exclusive_low else value >= self.low
        return above and (self.high is None or value <= self.high)

    def reason(self, value: Any) -> str | None:
        """Why ``value`` is refused, or None when it holds."""
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return f"must be {'an integer' if self.integer else 'a number'}, got {value!r}"
        if not self.integer and not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        return None if self.holds(value) else f"{self.words}, got {value}"


def _integers(low: int, high: int | None = None, rule: str | None = None) -> Range:
    return Range(low, high, rule=rule, integer=True)


# SamplingParams field -> its range; a field whose value may be None (off) is checked when set
RANGES: dict[str, Range] = {
    "n": _integers(1, MAX_N),
    "best_of": _integers(1, MAX_N),
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, exclusive_low=True),
    "top_k": _integers(-1, rule="must be -1 or 0 (off) or a positive integer"),
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 2.0, exclusive_low=True),
    "seed": _integers(-(2**63), 2**64 - 1, rule="must fit in 64 bits"),
    "max_tokens": _integers(0, rule="must be at least 1"),  # 0: the prompt alone (see the docstring)
    "min_tokens": _integers(0),
    "logprobs": _integers(0, MAX_LOGPROBS),
    "prompt_logprobs": _integers(0, MAX_LOGPROBS),
    "length_penalty": Range(-MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY),
}
LOGIT_BIAS_RANGE = Range(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
EARLY_STOPPING_RULE = 'must be true, false or "never"'
TOKEN_IDS_RULE = "must be a list of non-negative integer token ids"
LOGIT_BIAS_IDS_RULE = "token ids must be non-negative integers"
# what beam search would ignore (refused with it unless at its default), what only it uses
BEAM_REFUSED = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "logit_bias_token_ids", "min_tokens", "stop_token_ids", "logprobs", "prompt_logprobs", "guided")
BEAM_ONLY = ("length_penalty", "early_stopping")
_DEFAULTS = SamplingParams()
_TOP_K_OFF = (None, -1, 0)
_OFF_WHEN_NONE = ("top_k", "seed", "best_of", "logprobs", "prompt_logprobs")


def verify(params: SamplingParams) -> None:
    """Raise ``SamplingParamsError`` for the first rule ``params`` breaks (see the module's docstring)."""
    for name, valid in RANGES.items():
        value = getattr(params, name)
        reason = None if value is None and name in _OFF_WHEN_NONE else valid.reason(value)
        if reason is not None:
            raise SamplingParamsError(name, reason)
    _check_token_lists(params)
    if params.early_stopping not in EARLY_STOPPING or not isinstance(params.early_stopping, (bool, str)):
        raise SamplingParamsError("early_stopping", early_stopping_reason(params.early_stopping))
    if params.min_tokens > params.max_tokens:
        raise SamplingParamsError("min_tokens", f"must not exceed {{0}} ({params.max_tokens}), got {params.min_tokens}",
                                  ("max_tokens",))
    if params.best_of is not None and params.best_of < params.n:
        raise SamplingParamsError("best_of", f"must be greater than or equal to n, got best_of={params.best_of} "
                                             f"and n={params.n}")
    if params.use_beam_search:
        _check_beam_search(params)
    else:
        for name in BEAM_ONLY:
            if getattr(params, name) != getattr(_DEFAULTS, name):
                raise SamplingParamsError(name, f"applies only with use_beam_search; got {getattr(params, name)!r} "
                                                "without it")
    if params.pooling is not None and (params.pooling not in ("last", "mean") or params.max_tokens or params.n != 1):
        raise SamplingParamsError("pooling", f'must be "last" or "mean", with max_tokens 0 and n 1; got '
                                             f"{params.pooling!r}, max_tokens {params.max_tokens}, n {params.n}")
    if params.guided is not None:
        error = guide_error(params.guided) if isinstance(params.guided, str) else "it is not a spec's JSON text"
        if error is not None:
            raise SamplingParamsError("guided", f"cannot be followed: {error}")


def _check_token_lists(params: SamplingParams) -> None:
    ids, biases = params.logit_bias_token_ids, params.logit_bias_values
    if not _token_ids(ids):
        bad = next((t for t in ids if not _token_ids([t])), ids) if isinstance(ids, list) else ids
        raise SamplingParamsError("logit_bias_token_ids", logit_bias_id_reason(bad))
    if len(ids) > MAX_LOGIT_BIAS_ENTRIES:
        raise SamplingParamsError("logit_bias_token_ids", f"takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, "
                                                          f"got {len(ids)}")
    if len(biases) != len(ids):
        raise SamplingParamsError("logit_bias_values", f"must hold one bias per token id ({len(ids)}), "
                                                       f"got {len(biases)}")
    for bias in biases:
        reason = LOGIT_BIAS_RANGE.reason(bias)
        if reason is not None:
            raise SamplingParamsError("logit_bias_values", reason)
    if not _token_ids(params.stop_token_ids):
        raise SamplingParamsError("stop_token_ids", TOKEN_IDS_RULE)


def early_stopping_reason(value: Any) -> str:
    return f"{EARLY_STOPPING_RULE}, got {value!r}"


def logit_bias_id_reason(token_id: Any) -> str:
    return f"{LOGIT_BIAS_IDS_RULE}, got {token_id!r}"


def _token_ids(ids: Any) -> bool:
    return isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)


def _check_beam_search(params: SamplingParams) -> None:
    """Beam search ranks the raw log-probabilities greedily: what it would ignore is refused."""
    if params.temperature != 0.0:
        raise SamplingParamsError("temperature", f"must be 0 with use_beam_search, got {params.temperature}")
    for name in BEAM_REFUSED:
        value = getattr(params, name)
        if value != getattr(_DEFAULTS, name) and not (name == "top_k" and value in _TOP_K_OFF):
            raise SamplingParamsError(name, "is not supported with use_beam_search")
    if params.best_of is not None and params.best_of != params.n:
        raise SamplingParamsError("best_of", f"must equal n (the beam width) with use_beam_search, got "
                                             f"best_of={params.best_of} and n={params.n}")


@functools.lru_cache(maxsize=GUIDES_KEPT)
def guide_error(text: str) -> str | None:
    """Why ``compile_guide`` refuses the spec ``text``, or None when it takes it (a large schema
    takes tens of milliseconds to compile: the verdicts are kept)."""
    try:
        compile_guide(text)
    except RecursionError:
        return "the schema is nested too deeply"
    except ValueError as exc:  # what the spec asks is malformed or not supported (json's errors too)
        return str(exc)
    return None
