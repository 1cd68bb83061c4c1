"""The sampling, stopping, logprobs and streaming fields that completions and chat share.

Every problem raises ``APIError`` naming the parameter. Ranges follow OpenAI where it defines
them (temperature, penalties, logit_bias, logprobs) and vLLM for its extensions (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids). Token ids are checked against the
vocabulary later, in ``preprocess``, which knows the model.

Several choices per prompt: ``n`` (1 to ``MAX_N``) samples, or ``best_of`` (``n`` to ``MAX_N``)
samples of which the ``n`` with the highest cumulative log-probability are returned (OpenAI's
completions field; accepted on chat too, as vLLM does), or vLLM's beam search (``use_beam_search``,
beam width ``n``, ``length_penalty``, ``early_stopping``). ``best_of > n`` cannot stream (nothing
is known before every sample has finished), as OpenAI says. Beam search can: each returned
hypothesis comes as one chunk when the search ends. Beam search scores candidates by the model's
raw log-probabilities, greedily, so the sampling and logits-processing fields it would ignore
(temperature above 0, top_p, top_k, min_p, penalties, logit_bias, min_tokens, stop_token_ids,
logprobs, a ``best_of`` other than ``n``) are refused with it rather than silently dropped;
``length_penalty`` and ``early_stopping`` are refused without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.frontend.errors import (
    bad_request, describe, is_int, json_type, optional_bool, optional_int, optional_number,
)

MAX_STOP_STRINGS = 4
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_N = 128  # choices (n), samples (best_of) or beams per prompt, OpenAI's limit for n
MAX_LENGTH_PENALTY = 10.0  # |length_penalty|: length ** penalty stays a finite, non-zero float
_SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass
class GenerationOptions:
    """The fields completions and chat share. ``max_tokens`` is ``None`` when the client left it
    out; ``max_tokens_param`` is the name it came under (for error messages). ``logprobs`` is
    ``None`` (off) or how many most likely tokens to list with each token (0: only its own)."""

    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    best_of: int | None = None  # None: n
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False


def parse_options(body: dict[str, Any], max_tokens_names: tuple[str, ...]) -> GenerationOptions:
    """The shared fields of ``body``; logprobs are left to the caller (their shape differs)."""
    opts = GenerationOptions()
    for name in max_tokens_names:  # the first one given wins (max_completion_tokens for chat)
        value = optional_int(body, name)
        if value is not None:
            if value < 1:
                raise bad_request(f"{name} must be at least 1, got {value}", name)
            opts.max_tokens, opts.max_tokens_param = value, name
            break
    opts.temperature = _number_in(body, "temperature", 1.0, 0.0, 2.0)
    opts.top_p = optional_number(body, "top_p", 1.0)
    if not 0.0 < opts.top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {opts.top_p}", "top_p")
    top_k = optional_int(body, "top_k")
    if top_k is not None and top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (off) or a positive integer, got {top_k}", "top_k")
    opts.top_k = top_k if top_k is not None and top_k > 0 else None
    opts.min_p = _number_in(body, "min_p", 0.0, 0.0, 1.0)
    opts.presence_penalty = _number_in(body, "presence_penalty", 0.0, -2.0, 2.0)
    opts.frequency_penalty = _number_in(body, "frequency_penalty", 0.0, -2.0, 2.0)
    opts.repetition_penalty = optional_number(body, "repetition_penalty", 1.0)
    if not 0.0 < opts.repetition_penalty <= 2.0:
        raise bad_request(f"repetition_penalty must be in (0, 2], got {opts.repetition_penalty}",
                          "repetition_penalty")
    opts.logit_bias = _parse_logit_bias(body.get("logit_bias"))
    opts.seed = optional_int(body, "seed")
    if opts.seed is not None and not _SEED_RANGE[0] <= opts.seed <= _SEED_RANGE[1]:
        raise bad_request(f"seed must fit in 64 bits, got {opts.seed}", "seed")
    opts.min_tokens = optional_int(body, "min_tokens") or 0
    if opts.min_tokens < 0:
        raise bad_request(f"min_tokens must be at least 0, got {opts.min_tokens}", "min_tokens")
    if opts.max_tokens is not None and opts.min_tokens > opts.max_tokens:
        raise bad_request(
            f"min_tokens ({opts.min_tokens}) must not exceed {opts.max_tokens_param} ({opts.max_tokens})", "min_tokens"
        )
    opts.ignore_eos = optional_bool(body, "ignore_eos")
    opts.stop_token_ids = _token_id_list(body.get("stop_token_ids"), "stop_token_ids")
    opts.stop = _parse_stop(body.get("stop"))
    opts.stream = optional_bool(body, "stream")
    opts.include_usage = _parse_stream_options(body.get("stream_options"), opts.stream)
    _parse_groups(body, opts)
    return opts


def parse_num_logprobs(body: dict[str, Any], name: str) -> int | None:
    """An optional count of top logprobs in ``[0, MAX_LOGPROBS]``."""
    value = optional_int(body, name)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}", name)
    return value


def _number_in(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = optional_number(body, name, default)
    if not low <= value <= high:
        raise bad_request(f"{name} must be between {low:g} and {high:g}, got {value}", name)
    return value


def _parse_groups(body: dict[str, Any], opts: GenerationOptions) -> None:
    """``n``, ``best_of`` and beam search (see the module docstring)."""
    n = optional_int(body, "n")
    if n is not None:
        if not 1 <= n <= MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
        opts.n = n
    best_of = optional_int(body, "best_of")
    if best_of is not None:
        if not 1 <= best_of <= MAX_N:
            raise bad_request(f"best_of must be between 1 and {MAX_N}, got {best_of}", "best_of")
        if best_of < opts.n:
            raise bad_request(f"best_of must be greater than or equal to n, got best_of={best_of} and n={opts.n}",
                              "best_of")
        if opts.stream and best_of > opts.n:
            raise bad_request("best_of cannot be used with stream (unless it equals n): the best choices are known "
                              "only when every sample has finished", "best_of")
        opts.best_of = best_of
    opts.use_beam_search = optional_bool(body, "use_beam_search")
    opts.length_penalty = _number_in(body, "length_penalty", 1.0, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
    opts.early_stopping = _parse_early_stopping(body.get("early_stopping"))
    if opts.use_beam_search:
        _check_beam_search(body, opts)
        return
    if opts.length_penalty != 1.0:
        raise bad_request(f"length_penalty applies only with use_beam_search; got {opts.length_penalty} without it",
                          "length_penalty")
    if opts.early_stopping is not False:
        raise bad_request(f"early_stopping applies only with use_beam_search; got {opts.early_stopping!r} without it",
                          "early_stopping")


def _parse_early_stopping(value: Any) -> bool | str:
    if value is None:
        return False
    if isinstance(value, bool) or value == "never":
        return value
    raise bad_request(f'early_stopping must be true, false or "never", got {describe(value)}', "early_stopping")


def _check_beam_search(body: dict[str, Any], opts: GenerationOptions) -> None:
    """Refuse the fields beam search would ignore (it ranks the raw log-probabilities greedily)."""
    if body.get("temperature") is not None and opts.temperature != 0.0:
        raise bad_request(f"temperature must be 0 (or left out) with use_beam_search, got {opts.temperature}",
                          "temperature")
    opts.temperature = 0.0
    ignored = [
        ("top_p", opts.top_p != 1.0), ("top_k", opts.top_k is not None), ("min_p", opts.min_p != 0.0),
        ("presence_penalty", opts.presence_penalty != 0.0), ("frequency_penalty", opts.frequency_penalty != 0.0),
        ("repetition_penalty", opts.repetition_penalty != 1.0), ("logit_bias", bool(opts.logit_bias)),
        ("min_tokens", opts.min_tokens != 0), ("stop_token_ids", bool(opts.stop_token_ids)),
    ]
    for name, set_ in ignored:
        if set_:
            raise bad_request(f"{name} is not supported with use_beam_search", name)
    if opts.best_of is not None and opts.best_of != opts.n:
        raise bad_request(f"best_of must equal n (the beam width) with use_beam_search, got best_of={opts.best_of} "
                          f"and n={opts.n}", "best_of")


def check_beam_logprobs(opts: GenerationOptions, param: str) -> None:
    """Beam search returns no logprobs; called once the caller has parsed its logprobs field."""
    if opts.use_beam_search and opts.logprobs is not None:
        raise bad_request(f"{param} is not supported with use_beam_search", param)


def _parse_logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}`` with biases in [-100, 100]."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"logit_bias must be an object mapping token ids to numbers, got {json_type(value)}",
                          "logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(value)}", "logit_bias")
    bias = {}
    for key, number in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids (integers), got {key!r}", "logit_bias") from None
        if token_id < 0:
            raise bad_request(f"logit_bias: token id {token_id} is negative", "logit_bias")
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not -100 <= number <= 100:
            raise bad_request(f"logit_bias[{key!r}] must be a number between -100 and 100, got {describe(number)}",
                              "logit_bias")
        bias[token_id] = bias.get(token_id, 0.0) + float(number)  # "5" and "05" name one token
    return bias


def _parse_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request(f"stop must be a string or a list of strings, got {json_type(stop)}", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    return list(dict.fromkeys(stops))


def _parse_stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object, got {json_type(options)}", "stream_options")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise bad_request(
            f"stream_options.include_usage must be a boolean, got {json_type(include)}", "stream_options.include_usage"
        )
    return bool(include)


def _token_id_list(value: Any, param: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value):
        raise bad_request(f"{param} must be a list of non-negative integer token ids", param)
    return list(value)
