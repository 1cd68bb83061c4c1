"""Responses of /v1/messages in Anthropic's shapes, translated from chat's (``ReasoningChatShapes``,
which reads the tool calls and the reasoning): one message, whole or as Anthropic's events.

Whole: ``{id: "msg_...", type: "message", role, model, content, stop_reason, stop_sequence, usage:
{input_tokens, output_tokens}}``; ``content`` holds a ``thinking`` block (with a reasoning parser),
a ``text`` block (when there is text) and a ``tool_use`` block per call (``input``: the arguments
parsed; arguments cut short by ``max_tokens`` are ``{}``). ``stop_reason``: ``tool_use`` when the
reply made calls, ``max_tokens``, ``stop_sequence`` (with the one that matched) or ``end_turn``.

Streamed: ``message_start`` (no content, the input tokens), then per block ``content_block_start``,
its ``content_block_delta``\\ s (``thinking_delta``, ``text_delta`` or ``input_json_delta``) and
``content_block_stop``, then ``message_delta`` (stop reason, sequence, usage) and ``message_stop``,
each with its ``event:`` line; an engine error mid-stream is an ``error`` event. No ``[DONE]``.
"""

from __future__ import annotations

import json
from typing import Any

from services.frontend.errors import APIError
from services.frontend.reasoning_shapes import ReasoningChatShapes
from services.frontend.responses import Choice, ResponseShapes

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
DELTAS = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
          "tool_use": ("input_json_delta", "partial_json")}


def error_body(error: APIError) -> dict[str, Any]:
    """An error in Anthropic's shape."""
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def tool_use_id(call_id: str) -> str:
    """chat's call id (``chatcmpl-tool-<hex>``) as Anthropic's (``toolu_<hex>``)."""
    return "toolu_" + call_id.rsplit("-", 1)[-1]


def anthropic_usage(usage_: dict[str, Any]) -> dict[str, int]:
    return {"input_tokens": usage_["prompt_tokens"], "output_tokens": usage_["completion_tokens"]}


def stop_reason(finish_reason: str | None, made_calls: bool, stop_string: str | None) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if made_calls or finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if stop_string is not None else "end_turn"


class AnthropicShapes(ResponseShapes):
    def __init__(self, request_id: str, created: int, model: str, include_usage: bool = False, tokens: Any = None,
                 *, num_prompt_tokens: int = 0, **chat_options: Any) -> None:
        super().__init__(request_id, created, model, False, tokens)
        self.chat = ReasoningChatShapes(request_id, created, model, False, tokens, **chat_options)
        self.message_id = "msg_" + request_id.rsplit("-", 1)[-1]
        self.num_prompt_tokens = num_prompt_tokens
        self._block: str | None = None  # the kind of the block open in the stream
        self._num_blocks = 0
        self._made_calls = False
        self._finish: str | None = None

    def _message(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
                 usage_: dict[str, int]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage_}

    def full(self, choices: list[Choice], usage_: dict[str, int]) -> dict[str, Any]:
        [choice] = self.chat.full(choices, usage_)["choices"]
        message, content = choice["message"], []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                            "input": _input(call["function"]["arguments"])})
        sequence = choices[0].stop_string
        reason = stop_reason(choice["finish_reason"], bool(message.get("tool_calls")), sequence)
        return self._message(content, reason, sequence if reason == "stop_sequence" else None,
                             anthropic_usage(usage_))

    # ---------------------------------------------------------------- streamed

    def kept_special_ids(self, tokenizer: Any) -> frozenset[int]:
        return self.chat.kept_special_ids(tokenizer)

    def opening_chunks(self, indices: list[int]) -> list[dict[str, Any]]:
        usage_ = {"input_tokens": self.num_prompt_tokens, "output_tokens": 0}
        start = {"type": "message_start", "message": self._message([], None, None, usage_)}
        return [start] + self._translate(self.chat.opening_chunks(indices))

    def chunks(self, index: int, text: str, finish_reason: str | None, logprobs: Any = None) -> list[dict[str, Any]]:
        return self._translate(self.chat.chunks(index, text, finish_reason, None))

    def closing_chunks(self, usage_: dict[str, int], stop_strings: dict[int, str | None]) -> list[dict[str, Any]]:
        sequence = stop_strings.get(0)
        reason = stop_reason(self._finish, self._made_calls, sequence)
        delta = {"stop_reason": reason, "stop_sequence": sequence if reason == "stop_sequence" else None}
        return [{"type": "message_delta", "delta": delta, "usage": anthropic_usage(usage_)},
                {"type": "message_stop"}]

    def event(self, payload: dict[str, Any]) -> bytes:
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {payload['type']}\ndata: {data}\n\n".encode()

    def error_event(self, error: APIError) -> bytes:
        return self.event(error_body(error))

    def done(self) -> bytes:
        return b""

    def _translate(self, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Chat's chunks -> Anthropic's block events."""
        events: list[dict[str, Any]] = []
        for chunk in chunks:
            for choice in chunk["choices"]:
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    events += self._piece("thinking", delta["reasoning_content"])
                if delta.get("content"):
                    events += self._piece("text", delta["content"])
                for call in delta.get("tool_calls") or []:
                    events += self._call(call)
                if choice["finish_reason"] is not None:
                    self._finish = choice["finish_reason"]
                    events += self._close()
        return events

    def _piece(self, kind: str, text: str, opening: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        events = []
        if self._block != kind or opening is not None:
            events += self._close()
            block = opening or ({"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {}))
            events.append({"type": "content_block_start", "index": self._num_blocks, "content_block": block})
            self._block = kind
        if text:
            delta_type, key = DELTAS[kind]
            events.append({"type": "content_block_delta", "index": self._num_blocks,
                           "delta": {"type": delta_type, key: text}})
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        function = call.get("function", {})
        arguments = function.get("arguments") or ""
        if call.get("id") is None:  # more of the open call's arguments
            return self._piece("tool_use", arguments)
        self._made_calls = True
        opening = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"], "input": {}}
        return self._piece("tool_use", arguments, opening)

    def _close(self) -> list[dict[str, Any]]:
        if self._block is None:
            return []
        self._block = None
        self._num_blocks += 1
        return [{"type": "content_block_stop", "index": self._num_blocks - 1}]


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}  # cut short by max_tokens
    return value if isinstance(value, dict) else {}
