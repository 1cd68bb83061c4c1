"""Embedding requests at the engine: each input one prefill-only engine request
(``SamplingParams.pooling``, ``max_tokens`` 0) through the same scheduler, paged KV and batches as
generation, all of one HTTP request's inputs in flight at once; the vectors come back on their
last outputs (``RequestOutput.embedding``), pooled and not yet normalized."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import structlog

from services.frontend.errors import APIError
from services.frontend.state import FrontendState
from shared.messages import AddRequest, RequestOutput, SamplingParams

log = structlog.get_logger()


def normalized(vector: np.ndarray, dimensions: int | None = None) -> np.ndarray:
    """The first ``dimensions`` entries (a Matryoshka model's shorter embedding; None: all), then
    L2-normalized, float32."""
    v = vector[:dimensions].astype(np.float64)
    norm = np.linalg.norm(v)
    return (v / norm if norm > 0 else v).astype(np.float32)


async def embed_token_lists(state: FrontendState, request_id: str, token_lists: list[list[int]]) -> list[np.ndarray]:
    """The normalized pooled vector of each token list, in order. Raises ``APIError`` (400 for a
    request the engine refuses, 500 when it fails, 503 when it ends it)."""
    sampling = SamplingParams(max_tokens=0, pooling=state.model.pooling, eos_token_ids=list(state.model.eos_token_ids))
    ids = [request_id if len(token_lists) == 1 else f"{request_id}-{i}" for i in range(len(token_lists))]
    queues, finished, vectors = [], set(), []
    task = asyncio.current_task()  # so that a shutdown ends it (and aborts what is left) after its grace
    state.generating.add(task)
    try:
        for rid, tokens in zip(ids, token_lists):
            queues.append(state.client.add_request(AddRequest(rid, np.asarray(tokens, np.int32), sampling, time.time())))
            state.metrics.num_queued += 1  # --max-queue-len counts them until they are answered
        for i, queue in enumerate(queues):
            vectors.append(normalized(await _last_output(queue)))
            finished.add(i)
            state.metrics.num_queued -= 1
            state.metrics.prompt_tokens.inc(len(token_lists[i]))
    finally:
        state.metrics.num_queued -= len(queues) - len(finished)
        state.generating.discard(task)
        for i, rid in enumerate(ids[:len(queues)]):
            if i not in finished:
                state.client.abort(rid)
    log.info("embedded", num_inputs=len(token_lists), num_tokens=sum(map(len, token_lists)))
    return vectors


async def _last_output(queue) -> np.ndarray:
    while True:
        output: RequestOutput | None = await queue.get()
        if output is None:
            continue
        if output.finish_reason == "error":
            status = 500 if output.error_kind == "engine" else 400
            raise APIError(status, output.error or "the engine failed to embed this input",
                           "server_error" if status == 500 else "invalid_request_error")
        if output.finish_reason not in (None, "stop", "length"):
            raise APIError(503, output.error or f"the engine ended the request early ({output.finish_reason})",
                           "server_error")
        if output.finish_reason is not None:
            if not len(output.embedding):
                raise APIError(500, "the engine returned no embedding for this input", "server_error")
            return np.frombuffer(output.embedding, "<f4")
