"""The bodies of /v1/completions and /v1/chat/completions: JSON bytes to a parsed body, or a 400.

Every problem raises ``APIError`` with the offending parameter's name; nothing here tokenizes
(``preprocess`` does, and checks the lengths). Fields this module does not know are ignored, as
OpenAI clients send some; known fields whose non-default values we cannot honour are refused
(vLLM's ``guided_regex`` and ``guided_grammar`` too: ignored, they would pass free text for guided
output). Each route's own fields (prompt, echo, messages) are declared here, the generation fields
both routes share in ``options`` (structured outputs among them), and all are read through ``fields``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, TypeVar

from services.frontend.errors import bad_request, is_int, json_type, reject_constant
from services.frontend.field_kinds import Boolean, Custom, Refused, String, ignored
from services.frontend.fields import Route, declare, nested, read_declared
from services.frontend.options import GenerationOptions
from services.frontend.request_rules import check_options

CHAT_ROLES = ("system", "user", "assistant")
MAX_PROMPTS = 64  # prompts in one completions request; each is its own engine request

Prompt = str | list[int]
Body = TypeVar("Body", bound="RequestBody")


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


def check_model(body: dict[str, Any], served_model_name: str) -> None:
    """``model`` may be left out (the served model); any other name is a 400 ``model_not_found``."""
    model = body.get("model")
    if model is None:
        return
    if String().read("model", model) != served_model_name:
        raise bad_request(
            f"The model `{model}` does not exist. This server serves `{served_model_name}`.",
            "model",
            "model_not_found",
        )


# ---------------------------------------------------------------- prompts and messages


def parse_prompts(prompt: Any) -> list[Prompt]:
    """OpenAI's four shapes: a string, a list of strings, a list of token ids, a list of lists of
    token ids. Returns one entry per prompt; none may be empty."""
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


CHAT_MESSAGE_SCHEMA = {  # /openapi.json's ChatMessage
    "type": "object", "required": ["role", "content"],
    "properties": {
        "role": {"enum": list(CHAT_ROLES)},
        "content": {"oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
                "type": {"const": "text"}, "text": {"type": "string"}}}},
        ], "description": "May be null for an assistant message."},
    },
}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPTS = Custom(lambda name, value: parse_prompts(value), {"oneOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_PROMPTS},
    _TOKEN_IDS,
    {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_PROMPTS},
]})
MESSAGES = Custom(lambda name, value: parse_messages(value),
                  {"type": "array", "items": {"$ref": "#/components/schemas/ChatMessage"}, "minItems": 1})


def _off_when_empty(value: Any) -> bool:
    return not value


# ---------------------------------------------------------------- the two bodies


@dataclass
class RequestBody:
    """What both generation routes read, in this order: the model's name, the fields we refuse
    (OpenAI's, which we cannot honour yet), then the generation options."""

    model: str | None = declare(String(), description="The served model's name; may be left out.")
    suffix: Any = declare(Refused(_off_when_empty), routes=Route.COMPLETIONS)
    tools: Any = declare(Refused(_off_when_empty), routes=Route.CHAT)
    guided_regex: Any = declare(Refused(_off_when_empty))  # vLLM's; guided_json and guided_choice are supported
    guided_grammar: Any = declare(Refused(_off_when_empty))
    user: str | None = declare(ignored({"type": "string"}), description="Accepted and ignored.")
    options: GenerationOptions = nested(GenerationOptions)


@dataclass
class CompletionBody(RequestBody):
    echo: bool = declare(Boolean(), False, description="Each choice's text (and logprobs) starts with its prompt's.")
    prompts: list[Prompt] = declare(PROMPTS, factory=list, json_name="prompt", required=True,
                                    description="One prompt or several (strings or token ids); each gets n choices.")


@dataclass
class ChatBody(RequestBody):
    messages: list[dict[str, str]] = declare(MESSAGES, factory=list, required=True)


def parse_completion_body(body: dict[str, Any], served_model_name: str) -> CompletionBody:
    return _parse(CompletionBody, Route.COMPLETIONS, body, served_model_name)


def parse_chat_body(body: dict[str, Any], served_model_name: str) -> ChatBody:
    return _parse(ChatBody, Route.CHAT, body, served_model_name)


def _parse(cls: type[Body], route: Route, body: dict[str, Any], served_model_name: str) -> Body:
    check_model(body, served_model_name)  # first: a request meant for another model has nothing else to fix
    parsed = read_declared(cls, body, route)
    check_options(parsed.options, route, echo=isinstance(parsed, CompletionBody) and parsed.echo)
    return parsed
