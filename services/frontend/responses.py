"""Response bodies in OpenAI's shapes, for completions and chat, whole and streamed."""

from __future__ import annotations

import json
from typing import Any


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


def sse_event(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse_event("[DONE]")


class ResponseShapes:
    """Builds the bodies of one request. ``include_usage``: streamed chunks carry ``"usage": null``
    and a last chunk with empty ``choices`` carries the usage."""

    object_full = ""
    object_chunk = ""

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool = False) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model
        self.include_usage = include_usage

    def full(self, text: str, finish_reason: str, usage_: dict[str, int]) -> dict[str, Any]:
        return self._envelope(self.object_full, [self._full_choice(text, finish_reason)]) | {"usage": usage_}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self._chunk([self._chunk_choice(text, finish_reason)])

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        return self._envelope(self.object_chunk, []) | {"usage": usage_}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, choices)
        if self.include_usage:
            body["usage"] = None
        return body

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _full_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def _chunk_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShapes(ResponseShapes):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def _full_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def _chunk_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


class ChatShapes(ResponseShapes):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def opening_chunks(self) -> list[dict[str, Any]]:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self._chunk([role])]

    def _full_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}

    def _chunk_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text or finish_reason is None else {}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
