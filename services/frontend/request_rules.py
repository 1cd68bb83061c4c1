"""The rules that tie several generation fields together, checked once every field has been read
on its own (``options.GenerationOptions``). Each raises ``APIError`` naming the field to change.

- ``min_tokens`` must not exceed an explicit ``max_tokens``; ``max_tokens`` 0 only on completions
  with ``echo`` (the prompt alone, for scoring).
- chat's ``logprobs`` (a boolean) and ``top_logprobs`` settle into ``GenerationOptions.logprobs``.
- ``prompt_logprobs`` (vLLM's extension) is not streamed, as in vLLM: it comes in the whole
  response only (``echo`` with ``logprobs`` streams the prompt's logprobs, OpenAI's way).
- ``best_of`` is at least ``n``; ``best_of > n`` cannot stream (nothing is known before every
  sample has finished), as OpenAI says. Beam search can: each returned hypothesis comes as one
  chunk when the search ends.
- one guide at most (structured outputs: ``response_format`` other than text, ``guided_json``,
  ``guided_choice``; chat's named or "required" ``tool_choice`` is one too, checked in ``tools``).
- beam search: temperature 0 (or left out; it is set to 0), ``best_of`` equal to ``n``, and no
  field it would ignore (``BeamSearch.REFUSED``); without it, no field only it uses
  (``BeamSearch.ONLY``).
"""

from __future__ import annotations

from services.frontend.errors import bad_request
from services.frontend.fields import BeamSearch, Route, declared_fields
from services.frontend.guides import GUIDE_FIELDS
from services.frontend.options import GenerationOptions


def check_options(opts: GenerationOptions, route: Route, echo: bool = False) -> None:
    """Check ``opts`` as parsed for ``route`` (``echo``: a completions body asked for it), and
    settle what the rules decide (chat's logprobs, beam search's temperature)."""
    _check_lengths(opts, echo)
    if opts.prompt_logprobs is not None and opts.stream:
        raise bad_request("prompt_logprobs is not available with stream (as in vLLM); ask without stream, or "
                          "stream echo with logprobs", "prompt_logprobs")
    if route is Route.CHAT:
        _settle_chat_logprobs(opts)
    _check_best_of(opts)
    _check_one_guide(opts)
    if opts.use_beam_search:
        _check_beam_search(opts, route)
    else:
        _refuse_set(opts, route, BeamSearch.ONLY, "{name} applies only with use_beam_search; got {value!r} without it")


def _check_lengths(opts: GenerationOptions, echo: bool) -> None:
    if opts.max_tokens == 0 and not echo:  # (chat's kind refuses 0 when it is read)
        raise bad_request("max_tokens must be at least 1, got 0 (0 is accepted only with echo, to score the prompt)",
                          "max_tokens")
    if opts.max_tokens is not None and opts.min_tokens > opts.max_tokens:
        raise bad_request(f"min_tokens ({opts.min_tokens}) must not exceed {opts.max_tokens_param} "
                          f"({opts.max_tokens})", "min_tokens")


def _settle_chat_logprobs(opts: GenerationOptions) -> None:
    if opts.chat_logprobs:
        opts.logprobs = opts.top_logprobs or 0
    elif opts.top_logprobs is not None:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")


def _check_best_of(opts: GenerationOptions) -> None:
    best_of = opts.best_of
    if best_of is None:
        return
    if best_of < opts.n:
        raise bad_request(f"best_of must be greater than or equal to n, got best_of={best_of} and n={opts.n}",
                          "best_of")
    if opts.stream and best_of > opts.n:
        raise bad_request("best_of cannot be used with stream (unless it equals n): the best choices are known "
                          "only when every sample has finished", "best_of")


def _check_one_guide(opts: GenerationOptions) -> None:
    """Each guide constrains the whole output: two cannot both hold. The second one is named."""
    given = [opts.param(attr) for attr in GUIDE_FIELDS if getattr(opts, attr) is not None]
    if len(given) > 1:
        raise bad_request(f"{given[1]} cannot be combined with {given[0]}: give one of response_format, "
                          f"guided_json, guided_choice or structured_outputs", given[1])


def _check_beam_search(opts: GenerationOptions, route: Route) -> None:
    """Refuse what beam search would ignore: it ranks the raw log-probabilities greedily."""
    if "temperature" in opts.given and opts.temperature != 0.0:
        raise bad_request(f"temperature must be 0 (or left out) with use_beam_search, got {opts.temperature}",
                          "temperature")
    opts.temperature = 0.0
    _refuse_set(opts, route, BeamSearch.REFUSED, "{name} is not supported with use_beam_search")
    if opts.best_of is not None and opts.best_of != opts.n:
        raise bad_request(f"best_of must equal n (the beam width) with use_beam_search, got best_of={opts.best_of} "
                          f"and n={opts.n}", "best_of")


def _refuse_set(opts: GenerationOptions, route: Route, use: BeamSearch, message: str) -> None:
    """Refuse the first field marked ``use`` whose value is not its default."""
    for declared in declared_fields(GenerationOptions, route):
        value = getattr(opts, declared.attr)
        if declared.spec.beam_search is use and value != declared.default:
            name = opts.param(declared.attr)
            raise bad_request(message.format(name=name, value=value), name)
