"""The rules that tie several generation fields together where only a request's JSON can break
them, checked once every field has been read on its own (``options.GenerationOptions``); and the
way back from a rulebook violation (``shared.messages.sampling_rules``, checked on the
``SamplingParams`` built in ``preprocess``) to the JSON field the client sent. Each raises
``APIError`` naming the field to change.

- ``max_tokens`` 0 only on completions with ``echo`` (the prompt alone, for scoring).
- chat's ``logprobs`` (a boolean) and ``top_logprobs`` settle into ``GenerationOptions.logprobs``.
- ``prompt_logprobs`` (vLLM's extension) is not streamed, as in vLLM: it comes in the whole
  response only (``echo`` with ``logprobs`` streams the prompt's logprobs, OpenAI's way).
- ``best_of > n`` cannot stream (nothing is known before every sample has finished), as OpenAI
  says. Beam search can: each returned hypothesis comes as one chunk when the search ends.
- one guide at most (structured outputs: ``response_format`` other than text, ``guided_json``,
  ``guided_choice``; chat's named or "required" ``tool_choice`` is one too, checked in ``tools``).
- beam search: a temperature left out is 0 (the rulebook refuses any other).

The rulebook holds the rest: ranges, min_tokens against max_tokens, best_of against n, beam search's
refusals and the guide's spec.
"""

from __future__ import annotations

from services.frontend.errors import APIError, bad_request
from services.frontend.fields import Route, declared_fields
from services.frontend.guides import GUIDE_FIELDS
from services.frontend.options import GenerationOptions
from shared.messages.sampling_rules import SamplingParamsError

_DECLARED = {d.attr for d in declared_fields(GenerationOptions)}


def check_options(opts: GenerationOptions, route: Route, echo: bool = False) -> None:
    """Check ``opts`` as parsed for ``route`` (``echo``: a completions body asked for it), and
    settle what the rules decide (chat's logprobs, beam search's temperature)."""
    if opts.max_tokens == 0 and not echo:  # (chat's kind refuses 0 when it is read)
        raise bad_request("max_tokens must be at least 1, got 0 (0 is accepted only with echo, to score the prompt)",
                          "max_tokens")
    if opts.prompt_logprobs is not None and opts.stream:
        raise bad_request("prompt_logprobs is not available with stream (as in vLLM); ask without stream, or "
                          "stream echo with logprobs", "prompt_logprobs")
    if route is Route.CHAT:
        _settle_chat_logprobs(opts)
    if opts.stream and opts.best_of is not None and opts.best_of > opts.n:
        raise bad_request("best_of cannot be used with stream (unless it equals n): the best choices are known "
                          "only when every sample has finished", "best_of")
    _check_one_guide(opts)
    if opts.use_beam_search and "temperature" not in opts.given:
        opts.temperature = 0.0  # beam search ranks the raw log-probabilities


def _settle_chat_logprobs(opts: GenerationOptions) -> None:
    if opts.chat_logprobs:
        opts.logprobs = opts.top_logprobs or 0
    elif opts.top_logprobs is not None:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")


def _check_one_guide(opts: GenerationOptions) -> None:
    """Each guide constrains the whole output: two cannot both hold. The second one is named."""
    given = [opts.param(attr) for attr in GUIDE_FIELDS if getattr(opts, attr) is not None]
    if len(given) > 1:
        raise bad_request(f"{given[1]} cannot be combined with {given[0]}: give one of response_format, "
                          f"guided_json, guided_choice, guided_regex, guided_grammar or structured_outputs", given[1])


def json_param(opts: GenerationOptions, field: str) -> str:
    """The JSON field the client sent for ``SamplingParams`` field ``field`` (max_completion_tokens
    for max_tokens where it came so, the guide field that set ``guided``...)."""
    if field in ("logit_bias_token_ids", "logit_bias_values"):
        return opts.param("logit_bias")
    if field == "guided":
        return next((opts.param(attr) for attr in GUIDE_FIELDS if getattr(opts, attr) is not None), "tool_choice")
    if field == "prompt_logprobs" and opts.prompt_logprobs is None:
        return opts.param("logprobs")  # echo with logprobs scores the prompt
    return opts.param(field) if field in _DECLARED else field


def as_bad_request(error: SamplingParamsError, opts: GenerationOptions) -> APIError:
    """The rulebook's violation as the 400 naming the JSON field, with the rulebook's reason."""
    param = json_param(opts, error.field)
    return bad_request(f"{param} {error.worded(lambda field: json_param(opts, field))}", param)
