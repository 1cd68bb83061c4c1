"""Request bodies of the OpenAI API, parsed and validated field by field.

Every problem raises ``APIError`` with the offending parameter's name; nothing here tokenizes
(``preprocess`` does, and checks the lengths). Fields this module does not know are ignored, as
OpenAI clients send some; known fields whose non-default values we cannot honour are refused.
The fields completions and chat share are parsed in ``options``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.frontend.errors import bad_request, is_int, json_type, optional_bool, reject_constant
from services.frontend.options import GenerationOptions, check_beam_logprobs, parse_num_logprobs, parse_options

CHAT_ROLES = ("system", "user", "assistant")
MAX_PROMPTS = 64  # prompts in one completions request; each is its own engine request

Prompt = str | list[int]


@dataclass
class CompletionBody:
    prompts: list[Prompt]  # options.n choices each, in this order
    options: GenerationOptions
    echo: bool = False


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
    except RecursionError:
        raise bad_request("The request body is not valid JSON: it is nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got a JSON {json_type(body)}")
    if _SURROGATE_ESCAPE.search(raw) and not _is_unicode(body):
        raise bad_request("The request body is not valid JSON: a string holds a lone UTF-16 surrogate "
                          "(\\ud800-\\udfff)")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _is_unicode(value: Any) -> bool:
    """Whether every string in ``value`` is valid Unicode (JSON's escapes can make lone surrogates,
    which tokenizers refuse). Pairs are joined by the decoder, so only lone ones fail."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


def parse_completion_body(body: dict[str, Any], served_model_name: str) -> CompletionBody:
    check_model(body, served_model_name)
    _refuse_unsupported(body, _UNSUPPORTED_COMPLETION)
    options = parse_options(body, ("max_tokens",))
    options.logprobs = parse_num_logprobs(body, "logprobs")
    check_beam_logprobs(options, "logprobs")
    echo = optional_bool(body, "echo")
    return CompletionBody(parse_prompts(body.get("prompt")), options, echo)


def parse_chat_body(body: dict[str, Any], served_model_name: str) -> ChatBody:
    check_model(body, served_model_name)
    _refuse_unsupported(body, _UNSUPPORTED_CHAT)
    options = parse_options(body, ("max_completion_tokens", "max_tokens"))
    top_logprobs = parse_num_logprobs(body, "top_logprobs")
    if optional_bool(body, "logprobs"):
        options.logprobs = top_logprobs or 0
    elif top_logprobs is not None:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    check_beam_logprobs(options, "logprobs")
    return ChatBody(parse_messages(body.get("messages")), options)


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


def parse_prompts(prompt: Any) -> list[Prompt]:
    """OpenAI's four shapes: a string, a list of strings, a list of token ids, a list of lists of
    token ids. Returns one entry per prompt; none may be empty."""
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return [prompt]
    if not isinstance(prompt, list):
        raise bad_request(f"prompt must be a string or a list of token ids, got {json_type(prompt)}", "prompt")
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(is_int(t) for t in prompt):
        return [list(prompt)]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"prompt takes at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}", "prompt")
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        for idx, item in enumerate(prompt):
            if not item:
                raise bad_request(f"prompt[{idx}] must not be empty", "prompt")
            if isinstance(item, list) and not all(is_int(t) for t in item):
                raise bad_request(f"prompt[{idx}] must be a list of integer token ids", "prompt")
        return [p if isinstance(p, str) else list(p) for p in prompt]
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids", "prompt"
    )


def parse_messages(messages: Any) -> list[dict[str, str]]:
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


# Known fields we cannot honour, with the predicate that says a value means "off".
_UNSUPPORTED_COMPLETION = frozenset({
    ("suffix", lambda v: not v),
})
_UNSUPPORTED_CHAT = frozenset({
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
            raise bad_request(f"{name}={json.dumps(value)[:80]} is not supported yet", name)
