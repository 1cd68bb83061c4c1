"""One request's life on the frontend: send it, turn its token deltas into text deltas, end it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.engine_client import EngineClient
from shared.messages import AddRequest, RequestOutput, SamplingParams

log = structlog.get_logger()


class EngineRequestError(Exception):
    """The scheduler failed or dropped the request; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Delta:
    """New text since the previous delta; ``finish_reason`` is set on the last one."""

    text: str
    num_new_tokens: int
    finish_reason: str | None = None


class Generation:
    """Drives one request. Use as ``start()``, ``await next_delta()`` until ``finished``, and
    ``close()`` in a ``finally``: closing a request that has not finished aborts it at the scheduler
    (client gone, handler cancelled); a stop string aborts it as soon as it is found.
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
    ) -> None:
        self._client = client
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._sampling = sampling
        self._eos_token_ids = eos_token_ids
        self._detokenizer = IncrementalDetokenizer(tokenizer, stop)
        self._queue = None
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

    def start(self) -> None:
        request = AddRequest(
            request_id=self.request_id,
            prompt_token_ids=np.asarray(self.prompt_token_ids, dtype=np.int32),
            sampling=self._sampling,
            eos_token_ids=list(self._eos_token_ids),
            arrival_time=time.time(),
        )
        self._queue = self._client.add_request(request)
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
        for output in outputs:
            num_new += len(output.new_token_ids)
            text += self._detokenizer.add(output.new_token_ids)
            if self._detokenizer.stopped:
                break
        self.num_completion_tokens += num_new
        last = outputs[-1]
        if self._detokenizer.stopped:
            self._finish("stop")
            if last.finish_reason is None:
                self._client.abort(self.request_id)  # the rest would be cut anyway
        elif last.finish_reason is not None:
            self._check_failure(last)
            text += self._detokenizer.finish()
            self._finish(last.finish_reason)
        return Delta(text, num_new, self.finish_reason)

    def close(self) -> None:
        """Abort the request unless it finished; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.finished and self._queue is not None:
            self._client.abort(self.request_id)

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.finish_reason = reason
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
