"""The frontend's requests at the scheduler: where each one's outputs go, what each of its choices
has received, and how to hand them all to a restarted scheduler. Plain Python, no I/O: the engine
client sends the messages these methods return.

What reaches the scheduler are *parts* of a request: at first the request itself (under its own
id). After a scheduler restart (``resubmissions``), a request that had no output yet goes again
whole under a new id (``<id>.r<k>``); one that had outputs goes as one n = 1 part per unfinished
choice (``<id>.r<k>.c<choice>``), carrying what that choice received as ``resumed_token_ids``, so
the scheduler continues it exactly (its seed, for sampled choices, is the one the choice had:
``seed + choice``; the random stream starts again from it). A part's outputs are renamed to its
request and choice before they reach the request's queue, so the reader sees one uninterrupted
request, with the original prompt. best_of and beam search send nothing before their end, so one
with no output is simply run again; one that had sent part of its result cannot be resumed (the
samples it held back died with the scheduler) and ends with an error.

A request is over at its output marked ``request_finished`` (or when every choice has finished),
or at once on an ``"error"`` or ``"abort"`` of any part (its other parts are then returned for
aborting). Beam search may return fewer than ``n`` hypotheses: the queue then gets ``None`` after
the last output ("the other choices will not come").
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

import numpy as np
import structlog

from shared.messages import AbortRequest, AddRequest, RequestOutput

log = structlog.get_logger()

RESUME_REFUSED = ("the scheduler restarted after part of this request's result was sent; beam search and "
                  "best_of results cannot be resumed (the samples they held back were lost); retry the request")


@dataclass
class _Route:
    request: AddRequest  # as first sent
    queue: asyncio.Queue[RequestOutput | None]
    num_choices: int
    token_ids: list[list[int]]  # per choice, every token received so far
    finished: set[int] = field(default_factory=set)
    parts: set[str] = field(default_factory=set)  # ids under which it runs at the scheduler now
    num_resubmissions: int = 0
    any_output: bool = False


class RequestRoutes:
    def __init__(self) -> None:
        self._routes: dict[str, _Route] = {}
        self._parts: dict[str, tuple[str, int | None]] = {}  # part id -> (request id, its choice or None: all)
        self.num_dropped = 0  # outputs for a choice the request does not have

    def __len__(self) -> int:
        return len(self._routes)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._routes

    def add(self, request: AddRequest) -> asyncio.Queue[RequestOutput | None]:
        if request.request_id in self._routes:
            raise ValueError(f"request id {request.request_id} is already running")
        num_choices = max(1, request.sampling.n)
        route = _Route(request, asyncio.Queue(), num_choices, [[] for _ in range(num_choices)])
        self._routes[request.request_id] = route
        self._register(route, request.request_id, None)
        return route.queue

    def route(self, output: RequestOutput) -> list[str]:
        """Deliver one output to its request's queue; returns the parts to abort at the scheduler."""
        owner = self._parts.get(output.request_id)
        if owner is None:
            log.debug("output for an unknown or finished request", request_id=output.request_id)
            return []
        request_id, choice = owner
        route = self._routes[request_id]
        if output.request_finished:  # nothing more comes from this part: never abort it
            route.parts.discard(output.request_id)
            self._parts.pop(output.request_id)
        if choice is not None:
            output = dataclasses.replace(output, request_id=request_id, choice_idx=choice, request_finished=False)
        elif output.request_id != request_id:
            output = dataclasses.replace(output, request_id=request_id)
        reason = output.finish_reason
        if reason is not None and reason not in ("stop", "length"):
            return self._end(request_id, output)  # an error or abort ends every choice
        if not 0 <= output.choice_idx < route.num_choices or output.choice_idx in route.finished:
            self.num_dropped += 1
            log.error("dropped an output for a choice the request does not have", request_id=request_id,
                      choice_idx=output.choice_idx, num_choices=route.num_choices)
            return []
        route.any_output = True
        route.token_ids[output.choice_idx] += output.new_token_ids
        if reason is not None:
            route.finished.add(output.choice_idx)
        route.queue.put_nowait(output)
        if output.request_finished or len(route.finished) == route.num_choices:
            self._forget(request_id)
            if len(route.finished) < route.num_choices:
                route.queue.put_nowait(None)  # a beam search found fewer hypotheses than n
        return []

    def remove(self, request_id: str) -> list[str]:
        """Forget a request (the frontend gave up on it); returns its parts, to abort."""
        return self._forget(request_id)

    def end_all(self, reason: str) -> list[str]:
        """End every request with a ``finish_reason="abort"`` output carrying ``reason``; returns
        their parts, to abort."""
        parts = []
        for request_id in list(self._routes):
            parts += self._end(request_id, RequestOutput(request_id, 0, [], "abort", error=reason,
                                                         request_finished=True))
        return parts

    def request_ids(self) -> set[str]:
        return set(self._routes)

    def resubmissions(self, request_ids: set[str] | None = None) -> list[AbortRequest | AddRequest]:
        """Hand the requests (``request_ids`` that still run, default all) to a new scheduler: the
        messages to send, in order. Each old part is aborted first (it may have reached the new
        scheduler from the socket's queue)."""
        messages: list[AbortRequest | AddRequest] = []
        for request_id, route in list(self._routes.items()):
            if request_ids is not None and request_id not in request_ids:
                continue
            for part in route.parts:
                self._parts.pop(part, None)
                messages.append(AbortRequest(part))
            route.parts = set()
            route.num_resubmissions += 1
            plan = resume_plan(route)
            if isinstance(plan, str):
                log.warning("request cannot be resumed", request_id=request_id)
                self._end(request_id, RequestOutput(request_id, 0, [], "abort", error=plan, request_finished=True))
                continue
            for choice, request in plan:
                self._register(route, request.request_id, choice)
                messages.append(request)
        return messages

    def _register(self, route: _Route, part: str, choice: int | None) -> None:
        route.parts.add(part)
        self._parts[part] = (route.request.request_id, choice)

    def _end(self, request_id: str, output: RequestOutput) -> list[str]:
        route = self._routes[request_id]
        parts = self._forget(request_id)
        route.queue.put_nowait(output)
        return parts

    def _forget(self, request_id: str) -> list[str]:
        route = self._routes.pop(request_id, None)
        if route is None:
            return []
        for part in route.parts:
            self._parts.pop(part, None)
        return sorted(route.parts)


def resume_plan(route: _Route) -> list[tuple[int | None, AddRequest]] | str:
    """The parts that continue ``route`` at a new scheduler ((choice or None: all, request)), or
    why it cannot continue."""
    request, sampling = route.request, route.request.sampling
    prefix = f"{request.request_id}.r{route.num_resubmissions}"
    if not route.any_output:
        return [(None, dataclasses.replace(request, request_id=prefix))]
    if sampling.use_beam_search or (sampling.best_of or 0) > sampling.n:
        return RESUME_REFUSED
    parts = []
    for choice in range(route.num_choices):
        if choice in route.finished:
            continue
        seed = sampling.seed if sampling.seed is None or choice == 0 else (sampling.seed + choice) % 2**63
        parts.append((choice, dataclasses.replace(
            request, request_id=f"{prefix}.c{choice}",
            sampling=dataclasses.replace(sampling, n=1, best_of=None, seed=seed, prompt_logprobs=None),
            resumed_token_ids=np.asarray(route.token_ids[choice], np.int32))))
    return parts
