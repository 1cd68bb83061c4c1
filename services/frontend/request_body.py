"""The bodies of /v1/completions and /v1/chat/completions: JSON bytes to a parsed body, or a 400.

Every problem raises ``APIError`` with the offending parameter's name; nothing here tokenizes
(``preprocess`` does, and checks the lengths). Fields this module does not know are ignored, as
OpenAI clients send some; known fields whose non-default values we cannot honour are refused
(vLLM's ``guided_whitespace_pattern`` too: ignored, it would look followed). Each route's own fields (prompt, echo, messages, chat's tools and tool_choice, read in
``tools``) are declared here, the generation fields both routes share in ``options`` (structured
outputs among them), and all are read through ``fields``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, TypeVar

from services.frontend.errors import bad_request, describe, is_int, json_type, reject_constant
from services.frontend.field_kinds import Boolean, Custom, Refused, String, ignored
from services.frontend.fields import Route, declare, nested, read_declared
from services.frontend.options import GenerationOptions
from services.frontend.request_rules import check_options
from services.frontend.template_kwargs import TEMPLATE_KWARGS
from services.frontend.tools import MAX_TOOLS, TOOL_CHOICE, TOOLS, ToolChoice, settle_tool_choice

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer system
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


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages as transformers' chat templates take them: ``content`` always text (``""`` for
    an assistant message without any), ``developer`` as ``system``, an assistant's ``tool_calls``
    with each call's ``arguments`` as an object where its JSON text is one, and a ``tool`` message
    with its ``tool_call_id`` and the ``name`` of the call it answers (when an earlier message made it)."""
    if messages is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of message objects", "messages")
    parsed = []
    called: dict[str, str] = {}  # tool call id -> the function it called
    for idx, message in enumerate(messages):
        param = f"messages[{idx}]"
        if not isinstance(message, dict):
            raise bad_request(f"{param} must be an object, got {json_type(message)}", param)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(
                f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", f"{param}.role"
            )
        content = _message_text(message.get("content"), role, f"{param}.content")
        item: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and message.get("tool_calls"):  # (an empty list is none)
            item["tool_calls"] = _tool_calls(message["tool_calls"], f"{param}.tool_calls")
            called.update((c["id"], c["function"]["name"]) for c in item["tool_calls"])
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                got = "nothing" if call_id is None else json_type(call_id)
                raise bad_request(f"{param}.tool_call_id must be a string (the id of the call this message "
                                  f"answers), got {got}", f"{param}.tool_call_id")
            item["tool_call_id"] = call_id
            if call_id in called:
                item["name"] = called[call_id]
        parsed.append(item)
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


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant's calls, ``{"id", "type": "function", "function": {"name", "arguments"}}``,
    with ``arguments`` (JSON text, as OpenAI sends it) as the object it holds, which is how
    transformers' templates read it (``| tojson``, ``.items()``); text that is no JSON object stays text."""
    if not isinstance(calls, list):
        raise bad_request(f"{param} must be a list of tool calls, got {json_type(calls)}", param)
    out = []
    for idx, call in enumerate(calls):
        where = f"{param}[{idx}]"
        if not isinstance(call, dict):
            raise bad_request(f"{where} must be an object, got {json_type(call)}", param)
        if call.get("type", "function") != "function":
            raise bad_request(f'{where}.type must be "function", got {describe(call["type"])}', param)
        function = call.get("function")
        if not isinstance(call.get("id"), str) or not isinstance(function, dict):
            missing = "id (a string)" if not isinstance(call.get("id"), str) else "function (an object)"
            raise bad_request(f"{where} needs {missing}", param)
        for key in ("name", "arguments"):
            if not isinstance(function.get(key), str):
                got = "nothing" if function.get(key) is None else json_type(function[key])
                raise bad_request(f"{where}.function.{key} must be a string, got {got}", param)
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": _arguments(function["arguments"])}})
    return out


def _arguments(text: str) -> dict[str, Any] | str:
    try:
        value = json.loads(text, parse_constant=reject_constant)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


_TEXT = {"type": "string"}
_TEXT_PARTS = {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"const": "text"}, "text": {"type": "string"}}}}
_TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"type": "string"}, "arguments": {"type": "string", "description": "JSON text."}}}}}
CHAT_MESSAGE_SCHEMA = {"oneOf": [  # /openapi.json's ChatMessage
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user"]}, "content": {"oneOf": [_TEXT, _TEXT_PARTS]}},
     "description": "developer is read as system."},
    {"type": "object", "required": ["role"], "properties": {
        "role": {"const": "assistant"}, "content": {"oneOf": [_TEXT, _TEXT_PARTS, {"type": "null"}]},
        "tool_calls": {"type": "array", "items": _TOOL_CALL}}},
    {"type": "object", "required": ["role", "content", "tool_call_id"], "properties": {
        "role": {"const": "tool"}, "content": {"oneOf": [_TEXT, _TEXT_PARTS]}, "tool_call_id": {"type": "string"}}},
]}
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
    guided_whitespace_pattern: Any = declare(Refused(_off_when_empty))  # a pattern we would not follow
    guided_decoding_backend: str | None = declare(
        ignored({"type": "string"}), description="vLLM's choice of guide backend: accepted and ignored (one here).")
    user: str | None = declare(ignored({"type": "string"}), description="Accepted and ignored.")
    options: GenerationOptions = nested(GenerationOptions)


@dataclass
class CompletionBody(RequestBody):
    echo: bool = declare(Boolean(), False, description="Each choice's text (and logprobs) starts with its prompt's.")
    prompts: list[Prompt] = declare(PROMPTS, factory=list, json_name="prompt", required=True,
                                    description="One prompt or several (strings or token ids); each gets n choices.")


@dataclass
class ChatBody(RequestBody):
    """``parse_chat_body`` settles ``tool_choice`` (``tools.settle_tool_choice``): never None after it."""

    messages: list[dict[str, Any]] = declare(MESSAGES, factory=list, required=True)
    tools: list[dict[str, Any]] = declare(
        TOOLS, factory=list, description=f"Function tools (at most {MAX_TOOLS}), for the chat template and for "
                                         "tool_choice \"required\" or a named function.")
    tool_choice: ToolChoice | None = declare(
        TOOL_CHOICE, description='"none" (text; the default without tools), "required" (one call or more: its '
                                 'output follows the tools\' parameters), a named function (one call to it), or '
                                 '"auto" (the default with tools): free text, its tool calls read by the '
                                 'server\'s tool-call parser; refused unless it runs with --enable-auto-tool-choice.')
    parallel_tool_calls: bool = declare(
        Boolean(), True, description='With tool_choice "required" or "auto": false allows one call only.')
    chat_template_kwargs: dict[str, Any] = declare(TEMPLATE_KWARGS, factory=dict)


def parse_completion_body(body: dict[str, Any], served_model_name: str) -> CompletionBody:
    return _parse(CompletionBody, Route.COMPLETIONS, body, served_model_name)


def parse_chat_body(body: dict[str, Any], served_model_name: str, tool_parser: str | None = None) -> ChatBody:
    """``tool_parser``: the server's for tool_choice "auto" (None: "auto" is refused)."""
    return _parse(ChatBody, Route.CHAT, body, served_model_name, tool_parser)


def _parse(cls: type[Body], route: Route, body: dict[str, Any], served_model_name: str,
           tool_parser: str | None = None) -> Body:
    check_model(body, served_model_name)  # first: a request meant for another model has nothing else to fix
    parsed = read_declared(cls, body, route)
    check_options(parsed.options, route, echo=isinstance(parsed, CompletionBody) and parsed.echo)
    if isinstance(parsed, ChatBody):
        parsed.tool_choice, parsed.options.tool_guide = settle_tool_choice(parsed.tools, parsed.tool_choice,
                                                                           parsed.options, parsed.parallel_tool_calls,
                                                                           tool_parser)
    return parsed
