"""Chat's responses with ``--reasoning-parser`` (``reasoning``): each choice's reasoning in
``message.reasoning_content`` (streamed: ``delta.reasoning_content``), apart from its content.

``ReasoningChatShapes`` is chat's ``ChatShapes`` with a ``Reasoning`` layer in front: what reaches
``ChatShapes`` (and through it the tool calls) is the content only, whole or in pieces. Without a
parser, or for a request whose output a guide constrains from its first token (``response_format``,
the guided fields, a named or "required" tool_choice: the model has no room to think there), it
is ``ChatShapes`` as it is. Each choice (``n``) is split on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from services.frontend.guides import guided_text
from services.frontend.logprobs import TokenLogprob
from services.frontend.preprocess import PromptInput
from services.frontend.reasoning import Reasoning, StreamSplitter, reasoning_for
from services.frontend.responses import ChatShapes, Choice
from services.frontend.served_model import ServedModel

PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens whose text says whether it opened a <think>


def chat_reasoning(body: Any, model: ServedModel, inputs: list[PromptInput]) -> dict[str, Any]:
    """``ReasoningChatShapes``' ``reasoning`` argument for a chat request (None: no split)."""
    if model.reasoning_parser is None or guided_text(None, body.options)["guided"] is not None:
        return {"reasoning": None}
    tail = model.tokenizer.decode(inputs[0].token_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return {"reasoning": reasoning_for(model.reasoning_parser, tail)}


class ReasoningChatShapes(ChatShapes):
    def __init__(self, *args: Any, reasoning: Reasoning | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reasoning = reasoning
        self._splitters: dict[int, StreamSplitter] = {}
        self._held_logprobs: dict[int, list[TokenLogprob]] = {}  # tokens whose text is held (a partial tag)

    def _full_choice(self, choice: Choice) -> dict[str, Any]:
        if self.reasoning is None:
            return super()._full_choice(choice)
        reasoning, content = self.reasoning.split(choice.text)
        body = super()._full_choice(dataclasses.replace(choice, text=content or ""))
        message = body["message"]
        if content is None and message.get("content") == "":
            message["content"] = None
        message["reasoning_content"] = reasoning
        return body

    def chunks(
        self, index: int, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None
    ) -> list[dict[str, Any]]:
        """A reasoning piece in a chunk of its own, then the content's chunks (``ChatShapes``')."""
        if self.reasoning is None:
            return super().chunks(index, text, finish_reason, logprobs)
        splitter = self._splitters.setdefault(index, self.reasoning.streamer())
        reasoning, content = splitter.feed(text)
        if finish_reason is not None:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if index in self._held_logprobs:
            logprobs = self._held_logprobs.pop(index) + (logprobs or [])
        out = []
        if reasoning:
            out.append(self._chunk([self._choice(index, {"reasoning_content": reasoning}, None, logprobs)]))
            logprobs = None
        if content or finish_reason is not None:
            out += super().chunks(index, content, finish_reason, logprobs)
        elif logprobs:
            self._held_logprobs[index] = logprobs
        return out
