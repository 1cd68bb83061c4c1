"""A Responses API request (``/v1/responses``) as the chat request the frontend already serves:
``instructions`` as a first system message, ``input`` (a string, or message, ``function_call`` and
``function_call_output`` items) as messages, the flat ``tools`` as chat's, ``tool_choice``,
``max_output_tokens`` as ``max_tokens``, ``text.format`` as ``response_format``. What the chat
route checks (sampling values, tools' schemas) it checks; what only this API has is checked here,
with a 400 naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.frontend.errors import as_bool, bad_request, describe, is_int

# Accepted and passed to chat as they are.
_PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "seed", "stop", "user")
# Accepted, echoed or ignored: they change nothing here.
_IGNORED = ("metadata", "reasoning", "store", "stream", "truncation", "include", "service_tier", "background",
            "prompt_cache_key", "safety_identifier", "max_tool_calls", "top_logprobs", "stream_options")
_TRANSLATED = ("input", "instructions", "tools", "tool_choice", "max_output_tokens", "text",
               "previous_response_id")
KNOWN_FIELDS = frozenset(_PASSED + _IGNORED + _TRANSLATED)
TEXT_PART_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


@dataclass
class ResponsesRequest:
    """``chat``: the chat request's JSON object; ``messages``: the conversation this request adds
    (the previous response's, then ``input``'s; not ``instructions``), kept for a follow-up's
    ``previous_response_id``; ``fields``: the request as it is (echoed in the response)."""

    chat: dict[str, Any]
    messages: list[dict[str, Any]]
    fields: dict[str, Any]
    store: bool = True
    stream: bool = False
    previous: list[dict[str, Any]] = field(default_factory=list)


def read_request(body: dict[str, Any], previous: list[dict[str, Any]]) -> ResponsesRequest:
    """``previous``: the stored conversation ``previous_response_id`` names (``[]``: none)."""
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise bad_request(f"Unknown field {unknown[0]!r}: /v1/responses does not support it", unknown[0])
    if body.get("background"):
        raise bad_request("background responses are not supported: leave background false", "background")
    store = as_bool("store", body["store"]) if body.get("store") is not None else True
    stream = as_bool("stream", body["stream"]) if body.get("stream") is not None else False
    messages = previous + input_messages(body.get("input"))
    chat: dict[str, Any] = {name: body[name] for name in _PASSED if body.get(name) is not None}
    chat["messages"] = _instructions(body.get("instructions")) + messages
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        value = body["max_output_tokens"]
        if not is_int(value) or value < 1:
            raise bad_request(f"max_output_tokens must be an integer >= 1, got {describe(value)}", "max_output_tokens")
        chat["max_tokens"] = value
    if (response_format := _text_format(body.get("text"))) is not None:
        chat["response_format"] = response_format
    if stream:
        chat |= {"stream": True, "stream_options": {"include_usage": True}}
    return ResponsesRequest(chat, messages, body, store, stream, previous)


def _instructions(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, str):
        raise bad_request(f"instructions must be a string, got {describe(value)}", "instructions")
    return [{"role": "system", "content": value}]


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive ``function_call`` items make one assistant message
    with their tool calls (joined to the assistant message just before, if any)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request(f"input must be a string or a non-empty list of items, got {describe(value)}", "input")
    messages: list[dict[str, Any]] = []
    for idx, item in enumerate(value):
        param = f"input[{idx}]"
        if not isinstance(item, dict):
            raise bad_request(f"{param} must be an object, got {describe(item)}", param)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, param))
        elif kind == "function_call":
            _add_call(messages, item, param)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                             "content": _output_text(item.get("output"), f"{param}.output")})
        elif kind != "reasoning":  # a reasoning item carries nothing the prompt shows
            raise bad_request(f"{param}.type {kind!r} is not supported: use message, function_call, "
                              "function_call_output or reasoning items", f"{param}.type")
    return messages


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"{param}.role must be user, assistant, system or developer, got {describe(role)}",
                          f"{param}.role")
    return {"role": "system" if role == "developer" else role,
            "content": _output_text(item.get("content"), f"{param}.content")}


def _output_text(content: Any, param: str) -> str:
    """A string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of text parts, got {describe(content)}", param)
    texts = []
    for idx, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise bad_request(f"{param}[{idx}]: only text parts ({', '.join(TEXT_PART_TYPES[:2])}) are supported, "
                              f"got {describe(part)}", f"{param}[{idx}]")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param}.{name} must be a non-empty string, got {describe(value)}", f"{param}.{name}")
    return value


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise bad_request(f"{param}.arguments must be a string (JSON), got {describe(arguments)}", f"{param}.arguments")
    call = {"id": _string(item, "call_id", param), "type": "function",
            "function": {"name": _string(item, "name", param), "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return
    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request(f"tools must be a list, got {describe(tools)}", "tools")
    out = []
    for idx, tool in enumerate(tools):
        param = f"tools[{idx}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"{param}.type must be 'function' (the only tool type served), got {describe(kind)}",
                              f"{param}.type")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or {type: 'function', name}, got "
                      f"{describe(value)}", "tool_choice")


def _text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        if not isinstance(text, dict):
            raise bad_request(f"text must be an object, got {describe(text)}", "text")
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {describe(kind)}",
                      "text.format.type")
