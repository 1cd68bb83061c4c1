"""Response bodies in OpenAI's shapes, for completions and chat, whole and streamed (with vLLM's
``prompt_logprobs`` when asked: per choice on completions, on the response on chat; chat's tool
calls when its tool_choice makes the output calls, see ``tools``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from services.frontend.errors import APIError
from services.frontend.logprobs import TokenFormatter, TokenLogprob
from services.frontend.tool_parsers import kept_special_ids
from services.frontend.tool_parsers.streaming import StreamingToolParser
from services.frontend.tool_responses import new_call_id, parse_auto, parse_required, tool_call
from services.frontend.tools import AUTO, NAMED, REQUIRED, ToolChoice


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0,
          num_preemptions: int = 0) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens reused from the prefix cache and, as an extension,
    how many times the request was preempted for lack of KV memory."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
        "num_preemptions": num_preemptions,
    }


def sse_event(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse_event("[DONE]")


@dataclass
class Choice:
    """One finished choice. ``logprobs`` is None when the request asked for none."""

    index: int
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # vLLM's extension, when asked
    stop_string: str | None = None  # the stop string that ended it, if one did


@dataclass
class ResponseShapes:
    """Builds the bodies of one request. ``include_usage``: streamed chunks carry ``"usage": null``
    and a last chunk with empty ``choices`` carries the usage. ``tokens`` formats logprobs."""

    object_full: ClassVar[str] = ""
    object_chunk: ClassVar[str] = ""

    request_id: str
    created: int
    model: str
    include_usage: bool = False
    tokens: TokenFormatter | None = None

    def full(self, choices: list[Choice], usage_: dict[str, int]) -> dict[str, Any]:
        return self._envelope(self.object_full, [self._full_choice(c) for c in choices]) | {"usage": usage_}

    def opening_chunks(self, indices: list[int]) -> list[dict[str, Any]]:
        return []

    def kept_special_ids(self, tokenizer: Any) -> frozenset[int]:
        """Special tokens the text keeps (``detokenizer``): none, unless a tool-call parser reads them."""
        return frozenset()

    def chunk(
        self, index: int, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        return self._chunk([self._chunk_choice(index, text, finish_reason, logprobs)])

    def chunks(
        self, index: int, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None
    ) -> list[dict[str, Any]]:
        """The chunks one delta of a choice makes: one, but a shape may hold text back (none) or end
        a choice with more than one."""
        return [self.chunk(index, text, finish_reason, logprobs)]

    def usage_chunk(self, usage_: dict[str, int]) -> dict[str, Any]:
        return self._envelope(self.object_chunk, []) | {"usage": usage_}

    def closing_chunks(self, usage_: dict[str, int], stop_strings: dict[int, str | None]) -> list[dict[str, Any]]:
        """What a stream sends once every choice has finished (``stop_strings``: choice index -> the
        stop string that ended it, if one did): the usage chunk when asked for."""
        return [self.usage_chunk(usage_)] if self.include_usage else []

    def event(self, payload: dict[str, Any]) -> bytes:
        """One chunk as a server-sent event."""
        return sse_event(payload)

    def error_event(self, error: APIError) -> bytes:
        """An error that ends a stream, as an event."""
        return sse_event(error.to_dict())

    def done(self) -> bytes:
        """What ends a stream: OpenAI's ``[DONE]``."""
        return SSE_DONE

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, choices)
        if self.include_usage:
            body["usage"] = None
        return body

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _full_choice(self, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def _chunk_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        raise NotImplementedError


class CompletionShapes(ResponseShapes):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._text_offsets: dict[int, int] = {}  # per streamed choice: characters sent so far

    def _full_choice(self, choice: Choice) -> dict[str, Any]:
        logprobs = None
        if choice.logprobs is not None and self.tokens is not None:
            logprobs, _ = self.tokens.completion(choice.logprobs, 0)
        body = {"index": choice.index, "text": choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
        if choice.prompt_logprobs is not None and self.tokens is not None:
            body["prompt_logprobs"] = self.tokens.vllm_prompt(choice.prompt_logprobs)
        return body

    def _chunk_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        body = None
        if logprobs is not None and self.tokens is not None:
            body, self._text_offsets[index] = self.tokens.completion(logprobs, self._text_offsets.get(index, 0))
        return {"index": index, "text": text, "logprobs": body, "finish_reason": finish_reason}


# a "required" choice's text, ``[{"name": ..., "parameters": {...}}, ...]`` as its guide writes it, is
# what Mistral's v3 array reader reads (it takes "parameters" for "arguments"): streamed by it
REQUIRED_FORMAT = "mistral"


class ChatShapes(ResponseShapes):
    """``tool_choice``: the request's (``tools``); a named or "required" one makes each choice's
    text its tool calls (see ``tools`` for the shapes); "auto" reads the calls, if any, from the
    text with its parser (``tool_parsers``): content before them as content, ``finish_reason``
    "tool_calls" when there are calls (unless cut by ``length``). ``parallel_tool_calls`` false: an "auto" choice keeps its
    first call only."""

    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, *args: Any, tool_choice: ToolChoice | None = None, parallel_tool_calls: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tool_choice = tool_choice if tool_choice is not None and tool_choice.calls else None
        auto = tool_choice is not None and tool_choice.mode == AUTO
        self._parser = tool_choice.parser if auto else None  # "auto": the tool-call parser
        self._first_only = not parallel_tool_calls
        self._parsers: dict[int, StreamingToolParser] = {}  # "auto" and "required", streamed: per choice

    @property
    def _named(self) -> str | None:
        """The function a named tool_choice calls."""
        return self.tool_choice.name if self.tool_choice is not None and self.tool_choice.mode == NAMED else None

    @property
    def _required(self) -> bool:
        return self.tool_choice is not None and self.tool_choice.mode == REQUIRED

    def kept_special_ids(self, tokenizer: Any) -> frozenset[int]:
        """"auto": its parser's markers that the tokenizer writes as special tokens."""
        return kept_special_ids(self._parser, tokenizer, self._parser is not None)

    def full(self, choices: list[Choice], usage_: dict[str, int]) -> dict[str, Any]:
        """vLLM's ``prompt_logprobs`` is the response's here: the choices share the prompt."""
        body = super().full(choices, usage_)
        if choices and choices[0].prompt_logprobs is not None and self.tokens is not None:
            body["prompt_logprobs"] = self.tokens.vllm_prompt(choices[0].prompt_logprobs)
        return body

    def opening_chunks(self, indices: list[int]) -> list[dict[str, Any]]:
        """The role; a named call's header too (its arguments follow as they come)."""
        def delta() -> dict[str, Any]:
            if self._named is not None:
                return {"role": "assistant", "content": None, "tool_calls": [tool_call(self._named, "", 0)]}
            return {"role": "assistant", "content": None if self._required else ""}

        return [self._chunk([self._choice(i, delta(), None, None)]) for i in indices]

    def chunks(
        self, index: int, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None
    ) -> list[dict[str, Any]]:
        """"auto" and "required" choices: their calls as they come (``_call_chunks``)."""
        if self._parser is not None:
            return self._call_chunks(index, text, finish_reason, logprobs, self._parser, self._first_only)
        if self._required:  # every call, as the whole response has them
            return self._call_chunks(index, text, finish_reason, logprobs, REQUIRED_FORMAT, False)
        return super().chunks(index, text, finish_reason, logprobs)

    def _call_chunks(self, index: int, text: str, finish_reason: str | None,
                     logprobs: list[TokenLogprob] | None, parser_name: str, first_only: bool) -> list[dict[str, Any]]:
        """A choice's content as it comes (what may start a call held back), each call's header
        and its arguments in pieces as they come (``tool_parsers.streaming``), then the finish."""
        parser = self._parsers.setdefault(index, StreamingToolParser(parser_name, new_call_id, first_only))
        deltas = parser.feed(text)
        if finish_reason is not None:
            deltas += parser.finish()
            self._parsers.pop(index, None)
        if logprobs and not deltas:  # held text's logprobs go out as they come
            deltas = [{}]
        chunks = [self._chunk([self._choice(index, delta, None, logprobs if i == 0 else None)])
                  for i, delta in enumerate(deltas)]
        if finish_reason is not None:
            reason = _calls_finish(finish_reason) if parser.made_calls else finish_reason
            chunks.append(self._chunk([self._choice(index, {}, reason, None)]))
        return chunks

    def _full_choice(self, choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        finish_reason = choice.finish_reason
        if self._parser is not None:
            content, calls = parse_auto(self._parser, choice.text, self._first_only)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish_reason = _calls_finish(finish_reason)
        elif self._named is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [tool_call(self._named, choice.text)]}
        elif self._required and (calls := parse_required(choice.text)) is not None:
            message = {"role": "assistant", "content": None,
                       "tool_calls": [tool_call(name, arguments) for name, arguments in calls]}
            finish_reason = _calls_finish(finish_reason)
        logprobs = self.tokens.chat(choice.logprobs) if choice.logprobs is not None and self.tokens else None
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chunk_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None
    ) -> dict[str, Any]:
        if self._named is not None:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        else:
            delta = {"content": text} if text or finish_reason is None else {}
        return self._choice(index, delta, finish_reason, logprobs)

    def _choice(self, index: int, delta: dict[str, Any], finish_reason: str | None,
                logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        body = self.tokens.chat(logprobs) if logprobs is not None and self.tokens else None
        return {"index": index, "delta": delta, "logprobs": body, "finish_reason": finish_reason}


def _calls_finish(finish_reason: str) -> str:
    """A choice that finished with its calls: OpenAI's ``tool_calls`` (vLLM says ``stop`` for a
    "required" one); cut by ``length``, ``length``."""
    return "tool_calls" if finish_reason == "stop" else finish_reason
