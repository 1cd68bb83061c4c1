"""Anthropic's Messages request (/v1/messages, /v1/messages/count_tokens) as the chat request the
frontend already serves: the body is rewritten into chat's JSON and read by ``parse_chat_body``,
so every check, default and guide is chat's.

- ``system`` (a string or text blocks) -> a first system message; ``messages`` (roles user and
  assistant; content a string or blocks): ``text`` blocks join into the message's content;
  an assistant's ``tool_use`` blocks -> its ``tool_calls`` (``input`` as the arguments' JSON);
  a user's ``tool_result`` blocks -> one ``tool`` message each (``tool_call_id`` = ``tool_use_id``;
  ``is_error`` prefixes the content with ``Error: ``), before the user's text, if any;
  ``thinking`` blocks of earlier turns are dropped; ``image``, ``document`` and any other block are a 400.
- ``max_tokens`` (required), ``stop_sequences`` -> ``stop``, ``temperature``, ``top_p``, ``top_k``,
  ``stream``; ``metadata`` accepted and ignored.
- ``tools`` ``[{name, description, input_schema}]`` -> function tools; ``tool_choice``
  ``{"type": "auto"|"any"|"tool"|"none"}`` -> "auto", "required", the named function, "none"
  (``disable_parallel_tool_use`` -> ``parallel_tool_calls`` false). Left out with tools: "auto"
  when the server has a tool-call parser, else "none" (the tools still reach the chat template).
"""

from __future__ import annotations

import json
from typing import Any

from services.frontend.errors import bad_request, json_type
from services.frontend.request_body import ChatBody, parse_chat_body

PASSED = ("model", "temperature", "top_p", "top_k", "stream")  # same name, same meaning as chat's
IGNORED_BLOCKS = ("thinking", "redacted_thinking")  # earlier turns' reasoning: not shown to the model
CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def parse_messages_body(body: dict[str, Any], model_name: str, tool_parser: str | None,
                        count_only: bool = False) -> ChatBody:
    """An Anthropic body -> chat's parsed body (``count_only``: /count_tokens, no ``max_tokens``)."""
    return parse_chat_body(to_chat_request(body, tool_parser, count_only), model_name, tool_parser)


def to_chat_request(body: dict[str, Any], tool_parser: str | None, count_only: bool = False) -> dict[str, Any]:
    """The chat request's JSON for an Anthropic body; a 400 for what cannot be translated."""
    chat: dict[str, Any] = {key: body[key] for key in PASSED if key in body}
    if not count_only:
        if body.get("max_tokens") is None:
            raise bad_request("max_tokens is required", "max_tokens")
        chat["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    messages = _system(body.get("system"))
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    for idx, message in enumerate(raw_messages):
        messages += _message(message, f"messages[{idx}]")
    chat["messages"] = messages
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if count_only:  # what the tool choice guides does not change the prompt
        chat["tool_choice"] = "none"
    else:
        chat.update(_tool_choice(body.get("tool_choice"), bool(chat.get("tools")), tool_parser))
    return chat


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "" or system == []:
        return []
    return [{"role": "system", "content": _text(system, "system")}]


def _text(content: Any, param: str) -> str:
    """A string, or text blocks joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of text blocks, got {json_type(content)}", param)
    texts = []
    for idx, block in enumerate(content):
        if _kind(block, f"{param}[{idx}]") != "text":
            raise bad_request(f"{param}[{idx}] must be a text block, got {block['type']!r}", param)
        texts.append(_string(block, "text", f"{param}[{idx}]"))
    return "\n".join(texts)


def _kind(block: Any, param: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"{param} must be a content block (an object with a type)", param)
    if block["type"] in ("image", "document"):
        raise bad_request(f"{param}: {block['type']} content blocks are not supported (text models only)", param)
    return block["type"]


def _string(block: dict[str, Any], key: str, param: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        got = "nothing" if value is None else json_type(value)
        raise bad_request(f"{param}.{key} must be a string, got {got}", param)
    return value


def _message(message: Any, param: str) -> list[dict[str, Any]]:
    """One Anthropic message -> chat messages (a user's tool results come as tool messages)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise bad_request(f'{param} must be an object with role "user" or "assistant"', f"{param}.role")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{param}.content must be a string or a list of content blocks", f"{param}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for idx, block in enumerate(content):
        where, kind = f"{param}.content[{idx}]", _kind(block, f"{param}.content[{idx}]")
        if kind == "text":
            texts.append(_string(block, "text", where))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(block, where))
        elif kind == "tool_result" and role == "user":
            results.append(_result(block, where))
        elif kind not in IGNORED_BLOCKS:
            raise bad_request(f"{where}: a {kind} block is not supported in a {role} message", where)
    if role == "assistant":
        return [{"role": "assistant", "content": "\n".join(texts)} | ({"tool_calls": calls} if calls else {})]
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _call(block: dict[str, Any], param: str) -> dict[str, Any]:
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise bad_request(f"{param}.input must be an object, got {json_type(arguments)}", param)
    return {"id": _string(block, "id", param), "type": "function",
            "function": {"name": _string(block, "name", param), "arguments": json.dumps(arguments)}}


def _result(block: dict[str, Any], param: str) -> dict[str, Any]:
    content = block.get("content", "")
    text = _text(content, f"{param}.content")
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": _string(block, "tool_use_id", param), "content": text}


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request(f"tools must be a list of tools, got {json_type(tools)}", "tools")
    out = []
    for idx, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{idx}] must be an object, got {json_type(tool)}", "tools")
        if tool.get("type", "custom") != "custom":
            raise bad_request(f"tools[{idx}]: only custom tools (name, description, input_schema) are supported, "
                              f"got type {tool['type']!r}", "tools")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, has_tools: bool, tool_parser: str | None) -> dict[str, Any]:
    """Chat's ``tool_choice`` and ``parallel_tool_calls``."""
    if choice is None:
        return {"tool_choice": "none" if tool_parser is None else "auto"} if has_tools else {}
    if not isinstance(choice, dict) or choice.get("type") not in (*CHOICES, "tool"):
        raise bad_request('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                          '{"type": "tool", "name": ...}', "tool_choice")
    out: dict[str, Any] = {}
    if choice["type"] == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": _string(choice, "name", "tool_choice")}}
    else:
        out["tool_choice"] = CHOICES[choice["type"]]
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out
