"""A streamed Responses API answer built from chat's streamed chunks: ``response.created``,
``response.in_progress``, then per output item ``response.output_item.added``, its content part
(``response.content_part.added``), its deltas (``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta``), their ``.done``
events and ``response.output_item.done``; last ``response.completed`` (``response.incomplete``
when cut at ``max_output_tokens``) with the whole response. Every event has ``type`` and
``sequence_number``. An engine error ends the stream with ``error`` then ``response.failed``."""

from __future__ import annotations

import json
from typing import Any

from services.frontend.responses_output import (
    call_item, finished, item_id, message_item, output_text, reasoning_item,
)

# item type -> (the event names' middle, the content part's type); function calls have no part
_TEXT_KINDS = {"message": ("output_text", "output_text"), "reasoning": ("reasoning_text", "reasoning_text")}


def sse(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class ResponseEvents:
    """Feed it chat chunks (``feed``), then ``end``; each returns the events to send. ``base``: the
    response as ``responses_output.envelope`` made it."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base
        self.output: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None  # the whole response once ended
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text = ""  # its text or arguments so far
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.base),
                self._event("response.in_progress", response=self.base)]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if "error" in chunk:
            return self._failed(chunk["error"])
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text_delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text_delta("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            self._finish = choice.get("finish_reason") or self._finish
        return events

    def end(self) -> list[dict[str, Any]]:
        if self.final is not None:  # failed already
            return []
        events = self._close()
        self.final = finished(self.base, self.output, self._finish, self._usage)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self.final)]

    def _where(self) -> dict[str, Any]:
        return {"output_index": len(self.output) - 1, "item_id": self._open["id"]}

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events = self._close()
            item = message_item("") if kind == "message" else reasoning_item("")
            item["content"], item["status"] = [], "in_progress"
            events += self._add(item)
            part = {"type": _TEXT_KINDS[kind][1], "text": ""} | ({"annotations": []} if kind == "message" else {})
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        self._text += text
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self._event(f"response.{_TEXT_KINDS[kind][0]}.delta", **self._where(), content_index=0,
                                     delta=text, **extra)]

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        function = call.get("function") or {}
        events = []
        if call.get("id") is not None:  # a new call
            events = self._close()
            item = call_item(call["id"], function.get("name") or "", "", item_id("fc"))
            item["status"] = "in_progress"
            events += self._add(item)
        arguments = function.get("arguments") or ""
        if arguments and self._open is not None and self._open["type"] == "function_call":
            self._text += arguments
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open, self._text = item, ""
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _close(self) -> list[dict[str, Any]]:
        """The open item's ``.done`` events; the item in ``output`` made whole."""
        item = self._open
        if item is None:
            return []
        where, text, events = self._where(), self._text, []
        if item["type"] == "function_call":
            item["arguments"] = text
            events.append(self._event("response.function_call_arguments.done", **where, arguments=text))
        else:
            middle, part_type = _TEXT_KINDS[item["type"]]
            part = output_text(text) if item["type"] == "message" else {"type": part_type, "text": text}
            item["content"] = [part]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(self._event(f"response.{middle}.done", **where, content_index=0, text=text, **extra))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        item["status"] = "incomplete" if self._finish == "length" and item["type"] != "function_call" else "completed"
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=dict(item)))
        self._open, self._text = None, ""
        return events

    def _failed(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        self.final = self.base | {"status": "failed", "output": self.output,
                                  "error": {"code": "server_error", "message": error.get("message", "")}}
        return [self._event("error", code=error.get("code"), message=error.get("message", ""),
                            param=error.get("param")),
                self._event("response.failed", response=self.final)]
