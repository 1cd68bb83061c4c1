"""One engine request's life on the frontend: send it, turn its token deltas into text deltas, end it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import structlog

from services.frontend.detokenizer import IncrementalDetokenizer
from services.frontend.engine_client import EngineClient
from services.frontend.replicas import Replicas
from services.frontend.logprobs import TokenLogprob, prompt_entries, token_entries
from shared.messages import AddRequest, RequestOutput, SamplingParams

log = structlog.get_logger()


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
    """New text of one choice since its previous delta; ``finish_reason`` is set on its last one.
    ``index`` is the choice's index in the response."""

    index: int
    text: str
    num_new_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked for: one per new token


class ChoiceState:
    """One choice of a generation: its own text, stop strings and end."""

    def __init__(self, index: int, tokenizer: Any, stop: list[str], keep_special: frozenset[int] = frozenset()) -> None:
        self.index = index
        self.detokenizer = IncrementalDetokenizer(tokenizer, stop, keep_special)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.engine_done = False  # the scheduler sent this choice's last output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detokenizer.text

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended this choice, if one did."""
        return self.detokenizer.stop_string


class Generation:
    """Drives one engine request: ``sampling.n`` choices of one prompt (``best_of`` samples or a
    beam search of width ``n`` return at most ``n``). Use as ``start()``, ``await next_deltas()``
    until ``finished``, and ``close()`` in a ``finally``: closing a request that has not finished
    aborts it at the scheduler (client gone, handler cancelled).

    Each choice is detokenized and checked for stop strings on its own: a stop string finishes
    only its choice (its later tokens are dropped), and once every choice has finished the request
    is aborted at the scheduler if some of its sequences still run. Choice ``i`` is
    ``index_base + i`` in the response. ``choices`` lists the choices the response will have:
    after a beam search that found fewer than ``n`` hypotheses, only those.
    """

    def __init__(
        self,
        client: EngineClient | Replicas,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        tokenizer: Any,
        stop: list[str],
        *,
        index_base: int = 0,
        arrival_time: float | None = None,
        observer: GenerationObserver | None = None,
        keep_special: frozenset[int] = frozenset(),  # special tokens kept in the text (``detokenizer``)
    ) -> None:
        self._client = client
        self.request_id = request_id
        self.index_base = index_base
        self.prompt_token_ids = prompt_token_ids
        self._sampling = sampling
        self._all_choices = [ChoiceState(index_base + i, tokenizer, stop, keep_special)
                             for i in range(max(1, sampling.n))]
        self.choices = list(self._all_choices)
        self._observer = observer
        self._queue: asyncio.Queue[RequestOutput | None] | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_output_time: float | None = None  # any output came back (it left the queue)
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_completion_tokens = 0  # over every choice
        self.num_cached_tokens = 0  # prompt tokens the engine reused from its prefix cache
        self.num_preemptions = 0  # the most times any choice was preempted
        self._prompt_scores: RequestOutput | None = None  # the output that carried the prompt's logprobs
        self.finished = False
        self._engine_done = False  # nothing more will come from the scheduler
        self._closed = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_logprobs(self) -> list[TokenLogprob]:
        """The prompt's tokens with the logprobs the engine scored (``sampling.prompt_logprobs``):
        the first ``null``, and all ``null`` while (or if) none came."""
        return prompt_entries(self.prompt_token_ids, self._prompt_scores)

    @property
    def wants_logprobs(self) -> bool:
        return self._sampling.logprobs is not None

    @property
    def beam_search(self) -> bool:
        """Beam search: how many choices come back is known only at the end."""
        return self._sampling.use_beam_search

    @property
    def finish_reasons(self) -> list[str]:
        return [c.finish_reason for c in self.choices if c.finish_reason is not None]

    def start(self) -> None:
        if self._sampling.max_tokens == 0 and self._sampling.prompt_logprobs is None:
            self._start_prompt_only()
            return
        request = AddRequest(
            request_id=self.request_id,
            prompt_token_ids=np.asarray(self.prompt_token_ids, dtype=np.int32),
            sampling=self._sampling,
            arrival_time=time.time(),
        )
        self._queue = self._client.add_request(request)
        if self._observer is not None:
            self._observer.on_start(self)
        log.info("request sent", num_prompt_tokens=self.num_prompt_tokens, max_tokens=self._sampling.max_tokens,
                 n=self._sampling.n)

    def _start_prompt_only(self) -> None:
        """``max_tokens`` 0 (completions with echo) without prompt logprobs: nothing to generate or
        score, so nothing is sent and each choice ends at once, with no tokens and ``length``. (A
        request that wants the prompt's logprobs goes to the engine, which scores it and ends.)"""
        self._queue = asyncio.Queue()
        self._engine_done = True
        for choice_idx in range(len(self._all_choices)):
            self._queue.put_nowait(RequestOutput(self.request_id, choice_idx, [], "length"))
        if self._observer is not None:
            self._observer.on_start(self)

    async def next_deltas(self) -> list[Delta]:
        """Wait for the scheduler's next output(s) and return the text they release, one delta per
        choice that got any (in choice order; maybe none).

        Raises ``EngineRequestError`` when the scheduler reports an error or aborts on its own."""
        assert self._queue is not None and not self.finished
        outputs = [await self._queue.get()]
        while not self._queue.empty():
            outputs.append(self._queue.get_nowait())  # a slow client gets fewer, larger chunks
        deltas: dict[int, Delta] = {}
        num_new = 0
        for output in outputs:
            if output is None:  # a beam search returned fewer hypotheses than n
                self._engine_done = True
                self.choices = [c for c in self.choices if c.finished]
                continue
            if output.finish_reason is not None:
                self._check_failure(output)
            if output.prompt_logprobs:  # on the request's first output, whichever choice it is
                self._prompt_scores = output
            self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
            self.num_preemptions = max(self.num_preemptions, output.num_preemptions)
            choice = self._all_choices[output.choice_idx]  # the client checked the range
            choice.engine_done = choice.engine_done or output.finish_reason is not None
            if choice.finished:
                continue  # a stop string ended it: the rest is cut
            delta = deltas.setdefault(choice.index, Delta(choice.index, "", 0))
            delta.num_new_tokens += len(output.new_token_ids)
            choice.num_tokens += len(output.new_token_ids)
            num_new += len(output.new_token_ids)
            delta.text += choice.detokenizer.add(output.new_token_ids)
            if self.wants_logprobs:
                delta.logprobs += token_entries(output)
            if choice.detokenizer.stopped:
                choice.finish_reason = delta.finish_reason = "stop"
            elif output.finish_reason is not None:
                delta.text += choice.detokenizer.finish()
                choice.finish_reason = delta.finish_reason = output.finish_reason
        self._engine_done = self._engine_done or all(c.engine_done for c in self.choices)
        self._observe_output(num_new)
        if all(c.finished for c in self.choices):
            if not self._engine_done:
                self._engine_done = True
                self._client.abort(self.request_id)  # stop strings ended every choice: the rest would be cut
            self._finish()
        return [deltas[i] for i in sorted(deltas)]

    def close(self) -> None:
        """Abort the request unless it finished; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._engine_done and self._queue is not None:
            self._engine_done = True
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

    def _finish(self) -> None:
        self.finished = True
        self.finish_time = time.monotonic()
        if self._observer is not None:
            self._observer.on_finish(self)
        log.info(
            "request finished",
            finish_reasons=self.finish_reasons,
            num_prompt_tokens=self.num_prompt_tokens,
            num_completion_tokens=self.num_completion_tokens,
        )

    def _check_failure(self, output: RequestOutput) -> None:
        if output.finish_reason == "error":
            self.finished = self._engine_done = True
            log.warning("request failed in the engine", error=output.error, error_kind=output.error_kind)
            status = 500 if output.error_kind == "engine" else 400
            raise EngineRequestError(status, output.error or "the engine failed to run this request")
        if output.finish_reason not in ("stop", "length"):
            self.finished = self._engine_done = True
            log.warning("request ended by the engine", finish_reason=output.finish_reason)
            message = output.error or f"the engine ended the request early ({output.finish_reason})"
            raise EngineRequestError(503, message)

