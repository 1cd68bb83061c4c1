"""/v1/completions and /v1/chat/completions: parse, tokenize, admit, generate, answer.

A completions request with several prompts runs one engine request per prompt (ids
``<request id>-<index>``), concurrently; choice ``i`` answers prompt ``i``. Streamed, their chunks
interleave as tokens arrive, each naming its choice's index. With ``echo`` the prompt's text comes
first (streamed: in a chunk of its own), and with logprobs its tokens are listed with ``null``
logprobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog
from aiohttp import web

from services.frontend.errors import APIError, bad_request
from services.frontend.generation import Delta, EngineRequestError, Generation
from services.frontend.logprobs import TokenLogprob
from services.frontend.options import GenerationOptions
from services.frontend.preprocess import (
    DEFAULT_COMPLETION_MAX_TOKENS, PromptInput, chat_prompt_ids, completion_inputs, sampling_params,
)
from services.frontend.protocol import parse_chat_body, parse_completion_body, parse_json_body
from services.frontend.responses import (
    SSE_DONE, ChatShapes, Choice, CompletionShapes, ResponseShapes, sse_event, usage,
)
from services.frontend.state import REQUEST_ID, STATE, FrontendState

log = structlog.get_logger()


@dataclass
class _Echo:
    """What a choice starts with before its generated text (completions with ``echo``)."""

    text: str = ""
    logprobs: list[TokenLogprob] | None = None


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = time.monotonic()
    request_id = request[REQUEST_ID] = f"cmpl-{uuid.uuid4().hex}"
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        body = parse_completion_body(parse_json_body(await request.read()), state.model.name)
        inputs: list[PromptInput] = await state.tokenize(completion_inputs, body, state.model)
        echoes = [_echo(i, body.options) if body.echo else _Echo() for i in inputs]
        shapes = CompletionShapes(request_id, int(time.time()), state.model.name, body.options.include_usage,
                                  state.token_formatter)
        return await _generate(request, state, shapes, inputs, body.options, echoes, DEFAULT_COMPLETION_MAX_TOKENS,
                               "prompt", arrival)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = time.monotonic()
    request_id = request[REQUEST_ID] = f"chatcmpl-{uuid.uuid4().hex}"
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        body = parse_chat_body(parse_json_body(await request.read()), state.model.name)
        prompt_ids = await state.tokenize(chat_prompt_ids, body, state.model)
        shapes = ChatShapes(request_id, int(time.time()), state.model.name, body.options.include_usage,
                            state.token_formatter)
        return await _generate(request, state, shapes, [PromptInput(prompt_ids)], body.options, [_Echo()], None,
                               "messages", arrival)


def _echo(prompt: PromptInput, options: GenerationOptions) -> _Echo:
    entries = None
    if options.logprobs is not None:
        entries = [TokenLogprob(t, None, None) for t in prompt.token_ids]
    return _Echo(prompt.text or "", entries)


def _admit(state: FrontendState, num_requests: int) -> None:
    """Refuse work beyond ``--max-queue-len`` engine requests waiting for their first output."""
    limit = state.max_queue_len
    if limit is None:
        return
    if num_requests > limit:
        raise bad_request(f"this request has {num_requests} prompts; at most {limit} may wait at once "
                          f"(--max-queue-len)", "prompt")
    queued = state.metrics.num_queued
    if queued + num_requests > limit:
        raise APIError(
            503, f"The server is busy: {queued} requests are waiting for the engine and the limit is {limit} "
                 f"(--max-queue-len); retry later.",
            "server_error", code="queue_full", headers={"Retry-After": "1"},
        )


async def _generate(
    request: web.Request,
    state: FrontendState,
    shapes: ResponseShapes,
    inputs: list[PromptInput],
    options: GenerationOptions,
    echoes: list[_Echo],
    default_max_tokens: int | None,
    prompt_param: str,
    arrival: float,
) -> web.StreamResponse:
    model = state.model
    samplings = [sampling_params(options, len(i.token_ids), model, default_max_tokens, prompt_param) for i in inputs]
    _admit(state, len(inputs))
    single = len(inputs) == 1
    gens = [
        Generation(
            state.client, shapes.request_id if single else f"{shapes.request_id}-{idx}", prompt.token_ids,
            sampling, model.eos_token_ids, model.tokenizer, options.stop,
            index=idx, arrival_time=arrival, observer=state.metrics,
        )
        for idx, (prompt, sampling) in enumerate(zip(inputs, samplings))
    ]
    task = asyncio.current_task()
    state.generating.add(task)
    try:
        for gen in gens:
            gen.start()
        if options.stream:
            return await _stream(request, gens, shapes, echoes)
        logprobs: list[list[TokenLogprob]] = [list(e.logprobs or []) for e in echoes]
        for gen in gens:  # they run concurrently in the engine; their outputs wait in their queues
            while not gen.finished:
                delta = await gen.next_delta()
                logprobs[gen.index] += delta.logprobs
    except EngineRequestError as exc:
        raise _api_error(exc) from None
    finally:
        state.generating.discard(task)
        for gen in gens:
            gen.close()  # aborts unless finished: client gone, handler cancelled, or a bug
    choices = [
        Choice(g.index, echoes[g.index].text + g.text, g.finish_reason or "stop",
               logprobs[g.index] if g.wants_logprobs else None)
        for g in gens
    ]
    return web.json_response(shapes.full(choices, _usage(gens)))


def _usage(gens: list[Generation]) -> dict[str, int]:
    return usage(sum(g.num_prompt_tokens for g in gens), sum(g.num_completion_tokens for g in gens))


async def _stream(
    request: web.Request, gens: list[Generation], shapes: ResponseShapes, echoes: list[_Echo]
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    try:
        for chunk in shapes.opening_chunks([g.index for g in gens]):
            await response.write(sse_event(chunk))
        for gen in gens:
            echo = echoes[gen.index]
            if echo.text or echo.logprobs:
                await response.write(sse_event(shapes.chunk(gen.index, echo.text, None, echo.logprobs)))
        try:
            async with contextlib.aclosing(_deltas(gens)) as deltas:
                async for gen, delta in deltas:
                    if delta.text or delta.finish_reason is not None or delta.logprobs:
                        logprobs = delta.logprobs if gen.wants_logprobs else None
                        await response.write(sse_event(shapes.chunk(gen.index, delta.text, delta.finish_reason,
                                                                    logprobs)))
            if shapes.include_usage:
                await response.write(sse_event(shapes.usage_chunk(_usage(gens))))
        except EngineRequestError as exc:
            await response.write(sse_event(_api_error(exc).to_dict()))
        await response.write(SSE_DONE)
        await response.write_eof()
    except ConnectionResetError:
        log.info("client disconnected mid-stream", num_completion_tokens=sum(g.num_completion_tokens for g in gens))
    return response


async def _deltas(gens: list[Generation]) -> AsyncIterator[tuple[Generation, Delta]]:
    """Every delta of every generation, as each arrives, until all have finished."""
    if len(gens) == 1:
        gen = gens[0]
        while not gen.finished:
            yield gen, await gen.next_delta()
        return
    pending = {asyncio.ensure_future(g.next_delta()): g for g in gens if not g.finished}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=lambda f: pending[f].index):
                gen = pending.pop(future)
                delta = future.result()
                if not gen.finished:
                    pending[asyncio.ensure_future(gen.next_delta())] = gen
                yield gen, delta
    finally:
        for future in pending:
            future.cancel()


def _api_error(exc: EngineRequestError) -> APIError:
    return APIError(exc.status, exc.message, "invalid_request_error" if exc.status < 500 else "server_error")
