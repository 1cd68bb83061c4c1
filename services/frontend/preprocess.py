"""Parsed bodies -> prompt token ids and ``SamplingParams``, with the context-length and vocabulary
checks (what needs the model).

Tokenization is CPU work: the routes run these functions on the tokenizer threads, after checking
each text prompt's characters (``completion_text_chars``, ``chat_text_chars``; see ``input_limits``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.frontend.errors import bad_request
from services.frontend.fields import sampling_values
from services.frontend.generation_defaults import with_generation_defaults
from services.frontend.input_limits import chat_chars
from services.frontend.options import GenerationOptions
from services.frontend.request_body import ChatBody, CompletionBody
from services.frontend.request_rules import as_bad_request
from services.frontend.served_model import ServedModel
from shared.messages import SamplingParams
from shared.messages.sampling_rules import SamplingParamsError, verify

# The legacy completions API's default; chat defaults to whatever context is left.
DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass
class PromptInput:
    """One prompt as the engine gets it; ``text`` is set only when the client wants it echoed."""

    token_ids: list[int]
    text: str | None = None


def completion_inputs(body: CompletionBody, model: ServedModel) -> list[PromptInput]:
    """Tokenize (or check) every prompt of a completions request, in order."""
    inputs = []
    for prompt in body.prompts:
        if isinstance(prompt, str):
            ids = list(model.tokenizer.encode(prompt))
            _check_tokenized(ids, model, "prompt")
            text = prompt
        else:
            _check_token_ids(prompt, model.vocab_size, "prompt")
            ids = prompt
            text = model.tokenizer.decode(ids, skip_special_tokens=True) if body.echo else None
        inputs.append(PromptInput(ids, text if body.echo else None))
    return inputs


def completion_text_chars(body: CompletionBody) -> list[int]:
    """Characters of each text prompt (token-id prompts are not tokenized)."""
    return [len(prompt) for prompt in body.prompts if isinstance(prompt, str)]


def chat_text_chars(body: ChatBody) -> list[int]:
    """Characters of the messages' contents: the chat's one prompt, less what the template adds."""
    return [chat_chars(body.messages)]


def chat_inputs(body: ChatBody, model: ServedModel) -> list[PromptInput]:
    """A chat request's one prompt: its messages through the chat template."""
    return [PromptInput(chat_prompt_ids(body, model))]


def chat_prompt_ids(body: ChatBody, model: ServedModel, add_generation_prompt: bool = True) -> list[int]:
    """The messages through the chat template, with the tools (OpenAI's shape, which transformers
    takes as it is) for templates that show them; with tool_choice "none" too, as vLLM passes them; and
    the request's ``chat_template_kwargs`` (``template_kwargs``)."""
    try:
        ids = model.tokenizer.apply_chat_template(
            body.messages, tools=body.tools or None, add_generation_prompt=add_generation_prompt, tokenize=True,
            return_dict=False, **body.chat_template_kwargs,
        )
    except Exception as exc:  # a Jinja template may raise anything (TemplateError, ValueError...)
        raise bad_request(f"cannot apply the chat template to these messages: {exc}", "messages") from None
    ids = _as_id_list(ids)
    _check_tokenized(ids, model, "messages")
    return ids


def sampling_params(
    options: GenerationOptions,
    num_prompt_tokens: int,
    model: ServedModel,
    default_max_tokens: int | None,
    prompt_param: str,
    echo: bool = False,
) -> SamplingParams:
    """The engine's parameters: every field ``options`` declares for the engine (``FieldSpec.sampling``),
    the model's recommended defaults where the client gave none (``generation_defaults``), checked
    against the model, with ``max_tokens`` settled (``settle_max_tokens``), the EOS ids, and
    the prompt scored when the response shows its logprobs (``scored_prompt_top``; ``echo``: the
    prompt is echoed); then checked by the rulebook (``sampling_rules.verify``), a violation being
    a 400 naming the JSON field the client sent."""
    # the model's recommended defaults (--generation-config) for what the client left out; its length
    # replaces only chat's default (the context left), as in vLLM, and a directory's caps every request
    options = with_generation_defaults(options, model.generation_defaults)
    if default_max_tokens is None:
        default_max_tokens = model.generation_defaults.get("max_tokens")
    max_tokens = settle_max_tokens(options, num_prompt_tokens, model, default_max_tokens, prompt_param)
    if model.max_tokens_limit is not None:
        max_tokens = min(max_tokens, model.max_tokens_limit)
    _check_token_ids(options.stop_token_ids, model.vocab_size, "stop_token_ids")
    _check_token_ids(list(options.logit_bias), model.vocab_size, "logit_bias")
    values = sampling_values(options)
    if options.top_k is not None and options.top_k >= model.vocab_size:
        values["top_k"] = None  # a top_k beyond the vocabulary is no top_k
    values["prompt_logprobs"] = scored_prompt_top(options, echo)
    params = SamplingParams(**values, max_tokens=max_tokens, eos_token_ids=list(model.eos_token_ids))
    try:
        verify(params)  # the rulebook LLM runs too: ranges, min/max tokens, best_of, beam search, guide
    except SamplingParamsError as error:
        raise as_bad_request(error, options) from None
    return params


def scored_prompt_top(options: GenerationOptions, echo: bool) -> int | None:
    """How many most likely tokens the engine reports at each prompt position: vLLM's
    ``prompt_logprobs``, and when the prompt is echoed with ``logprobs`` (OpenAI's way to score a
    text), that many; the larger when both are asked (each view keeps its own). None: no scoring."""
    wanted = [k for k in (options.prompt_logprobs, options.logprobs if echo else None) if k is not None]
    return max(wanted, default=None)


def settle_max_tokens(
    options: GenerationOptions,
    num_prompt_tokens: int,
    model: ServedModel,
    default_max_tokens: int | None,
    prompt_param: str,
) -> int:
    """Check the lengths against ``model.max_model_len`` and settle ``max_tokens``.

    ``default_max_tokens`` applies when the client gave none (``None``: all the context left); a
    default is shrunk to fit, an explicit value that does not fit is a 400.
    """
    limit = model.max_model_len
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty after tokenization", prompt_param)
    if num_prompt_tokens >= limit:
        raise bad_request(
            f"The prompt has {num_prompt_tokens} tokens and the limit is {limit} tokens (max_model_len), "
            f"which leaves no room for a completion; shorten the prompt.",
            prompt_param,
            "context_length_exceeded",
        )
    room = limit - num_prompt_tokens
    if options.max_tokens is None:
        return room if default_max_tokens is None else min(default_max_tokens, room)
    if options.max_tokens > room:
        param = options.max_tokens_param
        raise bad_request(
            f"This model's maximum context length is {limit} tokens, but {num_prompt_tokens} prompt tokens "
            f"+ {options.max_tokens} {param} = {num_prompt_tokens + options.max_tokens} "
            f"tokens were requested; reduce the prompt or {param} (at most {room}).",
            param,
            "context_length_exceeded",
        )
    return options.max_tokens


def _check_tokenized(ids: list[int], model: ServedModel, param: str) -> None:
    """A text's tokens must be ids the model embeds: only a tokenizer with more tokens than the
    model's vocabulary (``--tokenizer`` of another model) can make one that is not."""
    if model.vocab_size < len(model.tokenizer) and ids and max(ids) >= model.vocab_size:
        raise bad_request(f"{param}: the text tokenizes to id {max(ids)}, beyond the model's vocabulary of "
                          f"{model.vocab_size} (the tokenizer has {len(model.tokenizer)} tokens)", param)


def _check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"{param}: token id {token_id} is out of range [0, {vocab_size})", param)


def _as_id_list(ids: Any) -> list[int]:
    if hasattr(ids, "keys") and "input_ids" in ids:  # a BatchEncoding from older/newer transformers
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]
