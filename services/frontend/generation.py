"""One engine request's life on the frontend: send it, turn its token deltas into text deltas, end it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import structlog

from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.engine_client import EngineClient
from services.frontend.logprobs import TokenLogprob
from shared.messages import AddRequest, RequestOutput, SamplingParams

log = structlog.get_logger()

MIN_LOGPROB = -9999.0  # JSON has no -Infinity


class EngineRequestError(Exception):
    """The scheduler failed or dropped the request; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class GenerationObserver(Protocol):
    """What the metrics see of a generation (all times ``time.monotonic()``)."""

    def on_start(self, gen: "Generation") -> None: ...
    def on_first_output(self, gen: "Generation") -> None: ...
    def on_tokens(self, gen: "Generation", num_tokens: int) -> None: ...
    def on_finish(self, gen: "Generation") -> None: ...


@dataclass
class Delta:
    """New text since the previous delta; ``finish_reason`` is set on the last one."""

    text: str
    num_new_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked for: one per new token


class Generation:
    """Drives one engine request (one choice). Use as ``start()``, ``await next_delta()`` until
    ``finished``, and ``close()`` in a ``finally``: closing a request that has not finished aborts
    it at the scheduler (client gone, handler cancelled); a stop string aborts it as soon as it is
    found. ``index`` is the choice's index in the response.
    """

    def __init__(
        self,
        client: EngineClient,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_ids: list[int],
        tokenizer: Any,
        stop: list[str],
        *,
        index: int = 0,
        arrival_time: float | None = None,
        observer: GenerationObserver | None = None,
    ) -> None:
        self._client = client
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self._sampling = sampling
        self._eos_token_ids = eos_token_ids
        self._detokenizer = IncrementalDetokenizer(tokenizer, stop)
        self._observer = observer
        self._queue = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_output_time: float | None = None  # any output came back (it left the queue)
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_completion_tokens = 0
        self.finish_reason: str | None = None
        self.finished = False
        self._closed = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def text(self) -> str:
        return self._detokenizer.text

    @property
    def wants_logprobs(self) -> bool:
        return self._sampling.logprobs is not None

    def start(self) -> None:
        request = AddRequest(
            request_id=self.request_id,
            prompt_token_ids=np.asarray(self.prompt_token_ids, dtype=np.int32),
            sampling=self._sampling,
            eos_token_ids=list(self._eos_token_ids),
            arrival_time=time.time(),
        )
        self._queue = self._client.add_request(request)
        if self._observer is not None:
            self._observer.on_start(self)
        log.info("request sent", num_prompt_tokens=self.num_prompt_tokens, max_tokens=self._sampling.max_tokens)

    async def next_delta(self) -> Delta:
        """Wait for the scheduler's next output(s) and return the text they release.

        Raises ``EngineRequestError`` when the scheduler reports an error or aborts on its own."""
        assert self._queue is not None and not self.finished
        outputs = [await self._queue.get()]
        while not self._queue.empty() and outputs[-1].finish_reason is None:
            outputs.append(self._queue.get_nowait())  # a slow client gets fewer, larger chunks
        num_new = 0
        text = ""
        logprobs: list[TokenLogprob] = []
        for output in outputs:
            num_new += len(output.new_token_ids)
            text += self._detokenizer.add(output.new_token_ids)
            if self.wants_logprobs:
                logprobs += _token_logprobs(output)
            if self._detokenizer.stopped:
                break
        self._observe_output(num_new)
        last = outputs[-1]
        if self._detokenizer.stopped:
            self._finish("stop")
            if last.finish_reason is None:
                self._client.abort(self.request_id)  # the rest would be cut anyway
        elif last.finish_reason is not None:
            self._check_failure(last)
            text += self._detokenizer.finish()
            self._finish(last.finish_reason)
        return Delta(text, num_new, self.finish_reason, logprobs)

    def close(self) -> None:
        """Abort the request unless it finished; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.finished and self._queue is not None:
            self._client.abort(self.request_id)
        if self.first_output_time is None and self._queue is not None:
            self._observe_output(0)  # it leaves the queue all the same

    def _observe_output(self, num_new: int) -> None:
        now = time.monotonic()
        self.num_completion_tokens += num_new
        if self.first_output_time is None:
            self.first_output_time = now
            if num_new and self.first_token_time is None:
                self.first_token_time = now
            if self._observer is not None:
                self._observer.on_first_output(self)
        elif num_new and self.first_token_time is None:
            self.first_token_time = now
        if num_new and self._observer is not None:
            self._observer.on_tokens(self, num_new)

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.finish_reason = reason
        self.finish_time = time.monotonic()
        if self._observer is not None and reason in ("stop", "length"):
            self._observer.on_finish(self)
        log.info(
            "request finished",
            finish_reason=reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_completion_tokens=self.num_completion_tokens,
        )

    def _check_failure(self, output: RequestOutput) -> None:
        if output.finish_reason == "error":
            self.finished = True
            log.warning("request failed in the engine", error=output.error)
            raise EngineRequestError(400, output.error or "the engine failed to run this request")
        if output.finish_reason not in ("stop", "length"):
            self.finished = True
            log.warning("request ended by the engine", finish_reason=output.finish_reason)
            message = output.error or f"the engine ended the request early ({output.finish_reason})"
            raise EngineRequestError(503, message)


def _token_logprobs(output: RequestOutput) -> list[TokenLogprob]:
    """The logprobs the scheduler attached, one per new token (a token without any gets None)."""
    entries = []
    tokens = output.new_token_ids
    offset = len(tokens) - len(output.logprobs)  # the scheduler attaches them to the last tokens
    for i, token_id in enumerate(tokens):
        j = i - offset
        if j < 0:
            entries.append(TokenLogprob(token_id, None, ()))
            continue
        top = tuple((t, _finite(v)) for t, v in zip(output.top_token_ids[j], output.top_logprobs[j]))
        entries.append(TokenLogprob(token_id, _finite(output.logprobs[j]), top))
    return entries


def _finite(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB
