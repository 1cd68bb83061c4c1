"""Request bodies of the OpenAI API, parsed and validated field by field.

Every problem raises ``APIError`` with the offending parameter's name; nothing here tokenizes
(``preprocess`` does, and checks the lengths). Fields this module does not know are ignored, as
OpenAI clients send some; known fields whose non-default values we cannot honour are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.frontend.errors import (
    bad_request, is_int, json_type, optional_bool, optional_int, optional_number, reject_constant,
)

MAX_STOP_STRINGS = 4
CHAT_ROLES = ("system", "user", "assistant")
_SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass
class GenerationOptions:
    """The fields completions and chat share. ``max_tokens`` is ``None`` when the client left it
    out; ``max_tokens_param`` is the name it came under (for error messages)."""

    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


@dataclass
class CompletionBody:
    prompt: str | list[int]
    options: GenerationOptions


@dataclass
class ChatBody:
    messages: list[dict[str, str]]  # {"role": ..., "content": str}
    options: GenerationOptions


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Bytes of a request body -> a JSON object, or a 400 saying why not."""
    try:
        body = json.loads(raw, parse_constant=reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got a JSON {json_type(body)}")
    return body


def parse_completion_body(body: dict[str, Any], served_model_name: str) -> CompletionBody:
    check_model(body, served_model_name)
    _refuse_unsupported(body, _UNSUPPORTED_COMMON | _UNSUPPORTED_COMPLETION)
    options = _parse_options(body, ("max_tokens",))
    return CompletionBody(_parse_prompt(body.get("prompt")), options)


def parse_chat_body(body: dict[str, Any], served_model_name: str) -> ChatBody:
    check_model(body, served_model_name)
    _refuse_unsupported(body, _UNSUPPORTED_COMMON | _UNSUPPORTED_CHAT)
    options = _parse_options(body, ("max_completion_tokens", "max_tokens"))
    return ChatBody(_parse_messages(body.get("messages")), options)


def check_model(body: dict[str, Any], served_model_name: str) -> None:
    """``model`` may be left out (the served model); any other name is a 400 ``model_not_found``."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {json_type(model)}", "model")
    if model != served_model_name:
        raise bad_request(
            f"The model `{model}` does not exist. This server serves `{served_model_name}`.",
            "model",
            "model_not_found",
        )


# ---------------------------------------------------------------- prompts and messages


def _parse_prompt(prompt: Any) -> str | list[int]:
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return prompt
    if not isinstance(prompt, list):
        raise bad_request(f"prompt must be a string or a list of token ids, got {json_type(prompt)}", "prompt")
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(is_int(t) for t in prompt):
        return list(prompt)
    if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return _parse_prompt(prompt[0])  # a batch of one
    if all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(
            f"batched prompts (a list of {len(prompt)} prompts) are not supported yet; send one request per prompt",
            "prompt",
        )
    raise bad_request("prompt must be a string, a list of token ids, or a list of one of those", "prompt")


def _parse_messages(messages: Any) -> list[dict[str, str]]:
    if messages is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of message objects", "messages")
    parsed = []
    for idx, message in enumerate(messages):
        param = f"messages[{idx}]"
        if not isinstance(message, dict):
            raise bad_request(f"{param} must be an object, got {json_type(message)}", param)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(
                f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", f"{param}.role"
            )
        parsed.append({"role": role, "content": _message_text(message.get("content"), role, f"{param}.content")})
    return parsed


def _message_text(content: Any, role: str, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts, got {json_type(content)}", param)
    texts = []
    for idx, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else json_type(part)
            raise bad_request(f"{param}[{idx}]: only text content parts are supported, got {kind!r}", param)
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{param}[{idx}].text must be a string, got {json_type(text)}", param)
        texts.append(text)
    return "\n".join(texts)


# ---------------------------------------------------------------- sampling and streaming options


def _parse_options(body: dict[str, Any], max_tokens_names: tuple[str, ...]) -> GenerationOptions:
    opts = GenerationOptions()
    for name in max_tokens_names:  # the first one given wins (max_completion_tokens for chat)
        value = optional_int(body, name)
        if value is not None:
            if value < 1:
                raise bad_request(f"{name} must be at least 1, got {value}", name)
            opts.max_tokens, opts.max_tokens_param = value, name
            break
    opts.temperature = optional_number(body, "temperature", 1.0)
    if not 0.0 <= opts.temperature <= 2.0:
        raise bad_request(f"temperature must be between 0 and 2, got {opts.temperature}", "temperature")
    opts.top_p = optional_number(body, "top_p", 1.0)
    if not 0.0 < opts.top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {opts.top_p}", "top_p")
    top_k = optional_int(body, "top_k")
    if top_k is not None and top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (off) or a positive integer, got {top_k}", "top_k")
    opts.top_k = top_k if top_k is not None and top_k > 0 else None
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
    n = optional_int(body, "n")
    if n is not None and n < 1:
        raise bad_request(f"n must be at least 1, got {n}", "n")
    if n is not None and n > 1:
        raise bad_request("n > 1 is not supported yet", "n")
    return opts


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


# Known fields we cannot honour yet, with the predicate that says a value means "off".
_UNSUPPORTED_COMMON = frozenset({
    ("presence_penalty", lambda v: v in (None, 0)),
    ("frequency_penalty", lambda v: v in (None, 0)),
    ("repetition_penalty", lambda v: v in (None, 1)),
    ("logit_bias", lambda v: not v),
    ("best_of", lambda v: v in (None, 1)),
})
_UNSUPPORTED_COMPLETION = frozenset({
    ("echo", lambda v: not v),
    ("logprobs", lambda v: v is None or v is False),
    ("suffix", lambda v: not v),
})
_UNSUPPORTED_CHAT = frozenset({
    ("logprobs", lambda v: not v),
    ("top_logprobs", lambda v: not v),
    ("tools", lambda v: not v),
    ("response_format", lambda v: not v or (isinstance(v, dict) and v.get("type") == "text")),
})


def _refuse_unsupported(body: dict[str, Any], fields: frozenset) -> None:
    for name, is_off in sorted(fields, key=lambda f: f[0]):
        value = body.get(name)
        try:
            off = is_off(value)
        except TypeError:
            off = False
        if not off:
            raise bad_request(f"{name}={json.dumps(value)} is not supported yet", name)
