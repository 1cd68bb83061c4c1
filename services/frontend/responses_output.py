"""The Responses API's objects built from chat's results: the response (``output`` items: a
reasoning item when the chat message has ``reasoning_content``, a message with its
``output_text``, a ``function_call`` per tool call), its usage, and the request's fields echoed
as the openai client's ``Response`` model needs them."""

from __future__ import annotations

import time
import uuid
from typing import Any

ECHOED = ("instructions", "max_output_tokens", "previous_response_id", "reasoning", "text", "top_p",
          "temperature", "user", "truncation", "service_tier", "top_logprobs", "max_tool_calls")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def envelope(response_id: str, created_at: int, model: str, fields: dict[str, Any], status: str) -> dict[str, Any]:
    """A response with no output yet: the request's fields echoed, ``status`` as given."""
    tools = [t for t in fields.get("tools") or [] if isinstance(t, dict)]
    body = {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "model": model,
        "output": [], "error": None, "incomplete_details": None, "usage": None,
        "parallel_tool_calls": fields.get("parallel_tool_calls", True) is not False,
        "tool_choice": fields.get("tool_choice") or "auto", "tools": tools,
        "metadata": fields.get("metadata"), "store": fields.get("store", True) is not False,
        "background": False,
    }
    for name in ECHOED:
        body.setdefault(name, fields.get(name))
    body["text"] = fields.get("text") or {"format": {"type": "text"}}
    return body


def finished(body: dict[str, Any], output: list[dict[str, Any]], finish_reason: str | None,
             usage: dict[str, Any] | None) -> dict[str, Any]:
    """``body`` completed with ``output``: "incomplete" (``max_output_tokens``) when the output was
    cut at the token limit."""
    incomplete = finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    for item in output:
        item["status"] = status if item["type"] != "function_call" else "completed"
    return body | {
        "status": status, "output": output, "usage": responses_usage(usage, output),
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "completed_at": None if incomplete else int(time.time()),
    }


def responses_usage(usage: dict[str, Any] | None, output: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Chat's usage in this API's names (reasoning tokens are not counted apart: 0)."""
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def reasoning_item(text: str, item: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item or item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(text: str, item: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item or item_id("msg"), "role": "assistant", "status": "completed",
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, item: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item or item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed"}


def output_of_chat(chat: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """A whole chat completion's first choice as output items, and its finish reason."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return output, choice["finish_reason"]


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a follow-up (``previous_response_id``) continues:
    one assistant message with its text and tool calls (reasoning left out)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return []
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]
