"""/v1/completions and /v1/chat/completions: parse, tokenize, admit, generate, answer.

Both routes take one path (``serve``; Anthropic's /v1/messages too: ``anthropic_routes``); an
``Endpoint`` holds the little that differs (body schema, prompt building, response shapes, default ``max_tokens``). A completions request with several prompts runs one engine request per prompt (ids
``<request id>-<index>``), concurrently. Each engine request has ``n`` choices (see
``generation``); as in OpenAI's API, choice ``j`` of prompt ``i`` has index ``i * n + j``. Streamed,
chunks interleave as tokens arrive, each naming its choice's index. ``usage`` counts each prompt
once and the tokens of every returned choice (with ``best_of``, not those of the samples dropped).
With ``echo`` each choice's text starts with its prompt's (streamed: in a chunk of its own), and
with ``logprobs`` its tokens are listed with the logprobs the engine scored (the first ``null``;
streamed, that chunk waits for the engine's first output). ``max_tokens`` 0 (only with ``echo``)
returns the prompt alone, each choice finished with ``length`` (see ``Generation``): the engine
only scores the prompt, and is not asked at all when no logprobs are wanted. vLLM's
``prompt_logprobs`` (not streamed) comes per choice on completions and once on chat.

Streamed beam search (vLLM's extension) is accepted: the hypotheses are known only when the search
ends, so each comes as one chunk then (for chat, after its own opening ``role`` chunk), best first.
``best_of > n`` is refused with ``stream`` when the body is parsed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import structlog
from aiohttp import web

from services.frontend.chat_stream import api_error, stream_chunks, write_sse
from services.frontend.errors import APIError, bad_request
from services.frontend.generation import EngineRequestError, Generation
from services.frontend.logprobs import TokenLogprob, with_top
from services.frontend.options import GenerationOptions
from services.frontend.http_limits import read_body
from services.frontend.input_limits import check_prompt_chars
from services.frontend.preprocess import (
    DEFAULT_COMPLETION_MAX_TOKENS, PromptInput, chat_inputs, chat_text_chars, completion_inputs,
    completion_text_chars, sampling_params,
)
from services.frontend.request_body import RequestBody, parse_chat_body, parse_completion_body, parse_json_body
from services.frontend.reasoning_shapes import ReasoningChatShapes, chat_reasoning
from services.frontend.responses import Choice, CompletionShapes, ResponseShapes, usage
from services.frontend.served_model import ServedModel
from services.frontend.state import REQUEST_ID, STATE, FrontendState

log = structlog.get_logger()


@dataclass(frozen=True)
class Endpoint:
    """What makes /v1/completions and /v1/chat/completions differ; everything else they share."""

    id_prefix: str
    parse: Callable[[dict[str, Any], ServedModel], RequestBody]  # JSON object, served model -> body
    inputs: Callable[[Any, ServedModel], list[PromptInput]]  # body -> its prompts (on the tokenizer thread)
    text_chars: Callable[[Any], list[int]]  # body -> characters of each text prompt (checked before tokenizing)
    shapes: type[ResponseShapes]
    default_max_tokens: int | None  # when the client gives none (None: the context left)
    prompt_param: str  # the field to blame for a prompt that does not fit
    # body, model, prompts -> more arguments of ``shapes`` (chat's tool choice and reasoning parser)
    shape_options: Callable[[Any, ServedModel, list[PromptInput]], dict[str, Any]] = lambda body, model, inputs: {}


def _chat_shape_options(body: Any, model: ServedModel, inputs: list[PromptInput]) -> dict[str, Any]:
    return {"tool_choice": body.tool_choice, "parallel_tool_calls": body.parallel_tool_calls,
            **chat_reasoning(body, model, inputs)}


COMPLETIONS = Endpoint("cmpl", lambda raw, model: parse_completion_body(raw, model.name), completion_inputs,
                       completion_text_chars, CompletionShapes, DEFAULT_COMPLETION_MAX_TOKENS, "prompt")
CHAT = Endpoint("chatcmpl", lambda raw, model: parse_chat_body(raw, model.name, model.tool_parser), chat_inputs,
                chat_text_chars, ReasoningChatShapes, None, "messages", _chat_shape_options)


@dataclass(frozen=True)
class Sink:
    """How a result leaves: ``full`` turns the whole body into the response; ``stream`` sends the
    chunks (``chat_stream.stream_chunks``) and returns the response it sent them on."""

    full: Callable[[dict[str, Any]], web.StreamResponse]
    stream: Callable[[web.Request, AsyncIterator[dict[str, Any]], ResponseShapes], Awaitable[web.StreamResponse]]


HTTP_SINK = Sink(web.json_response, write_sse)  # the routes' own: JSON, or server-sent events


@dataclass
class _Echo:
    """What a choice starts with before its generated text (completions with ``echo``): the
    prompt's text and, when ``logprobs`` asks for ``num_top``, its tokens' logprobs."""

    text: str = ""
    num_top: int | None = None

    def logprobs(self, gen: Generation) -> list[TokenLogprob] | None:
        return None if self.num_top is None else with_top(gen.prompt_logprobs, self.num_top)


async def create_completion(request: web.Request) -> web.StreamResponse:
    return await serve(request, COMPLETIONS)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    return await serve(request, CHAT)


async def serve(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    arrival = time.monotonic()
    request_id = request[REQUEST_ID] = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
    with structlog.contextvars.bound_contextvars(request_id=request_id):
        raw = await read_body(request)
        return await serve_object(request, endpoint, parse_json_body(raw), len(raw), arrival, HTTP_SINK)


async def serve_object(request: web.Request, endpoint: Endpoint, obj: dict[str, Any], num_bytes: int,
                       arrival: float, sink: Sink) -> web.StreamResponse:
    """Parse ``obj`` (the request's JSON object, ``num_bytes`` long) with the endpoint's schema,
    check the prompts' sizes, tokenize, admit, generate, and answer through ``sink``. The request's
    id is ``request[REQUEST_ID]``, set by the caller."""
    state = request.app[STATE]
    body = endpoint.parse(obj, state.model)
    model = state.model
    for num_chars in endpoint.text_chars(body):
        check_prompt_chars(num_chars, model.max_model_len, model.max_token_chars, endpoint.prompt_param)
    inputs: list[PromptInput] = await state.tokenize(num_bytes, endpoint.inputs, body, model)
    echoes = [_echo(prompt, body.options) for prompt in inputs]
    shapes = endpoint.shapes(request[REQUEST_ID], int(time.time()), state.model.name, body.options.include_usage,
                             state.token_formatter, **endpoint.shape_options(body, model, inputs))
    return await _generate(request, state, shapes, inputs, body.options, echoes, endpoint, arrival, sink)


def _echo(prompt: PromptInput, options: GenerationOptions) -> _Echo:
    """Nothing unless the prompt is echoed (its text is then kept)."""
    return _Echo() if prompt.text is None else _Echo(prompt.text, options.logprobs)


def _admit(state: FrontendState, num_requests: int) -> None:
    """Refuse work while the scheduler is lost, and beyond ``--max-queue-len`` engine requests
    waiting for their first output."""
    if state.client.scheduler_lost:
        raise APIError(
            503, f"The engine is unavailable: the scheduler has not answered for "
                 f"{state.client.scheduler_silence_s():.0f} s (it is being restarted); retry later.",
            "server_error", code="engine_unavailable", headers={"Retry-After": "2"},
        )
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
    endpoint: Endpoint,
    arrival: float,
    sink: Sink,
) -> web.StreamResponse:
    model = state.model
    samplings = [sampling_params(options, len(i.token_ids), model, endpoint.default_max_tokens, endpoint.prompt_param,
                                 echo=i.text is not None) for i in inputs]
    _admit(state, len(inputs))
    single = len(inputs) == 1
    gens = [
        Generation(
            state.client, shapes.request_id if single else f"{shapes.request_id}-{idx}", prompt.token_ids,
            sampling, model.tokenizer, options.stop,
            index_base=idx * options.n, arrival_time=arrival, observer=state.metrics,
            keep_special=shapes.kept_special_ids(model.tokenizer),
        )
        for idx, (prompt, sampling) in enumerate(zip(inputs, samplings))
    ]
    task = asyncio.current_task()
    state.generating.add(task)
    try:
        for gen in gens:
            gen.start()
        if options.stream:
            return await sink.stream(request, stream_chunks(gens, shapes, echoes, _usage), shapes)
        logprobs: dict[int, list[TokenLogprob]] = {}  # choice index -> its logprobs so far
        for gen in gens:  # they run concurrently in the engine; their outputs wait in their queues
            while not gen.finished:
                for delta in await gen.next_deltas():
                    logprobs.setdefault(delta.index, []).extend(delta.logprobs)
    except EngineRequestError as exc:
        raise api_error(exc) from None
    finally:
        state.generating.discard(task)
        for gen in gens:
            gen.close()  # aborts unless finished: client gone, handler cancelled, or a bug
    choices = [
        Choice(c.index, echo.text + c.text, c.finish_reason or "stop",
               (echo.logprobs(gen) or []) + logprobs.get(c.index, []) if gen.wants_logprobs else None,
               None if options.prompt_logprobs is None else with_top(gen.prompt_logprobs, options.prompt_logprobs),
               c.stop_string)
        for gen, echo in zip(gens, echoes)
        for c in gen.choices
    ]
    return sink.full(shapes.full(choices, _usage(gens)))


def _usage(gens: list[Generation]) -> dict[str, int]:
    return usage(sum(g.num_prompt_tokens for g in gens), sum(g.num_completion_tokens for g in gens),
                 sum(g.num_cached_tokens for g in gens), max((g.num_preemptions for g in gens), default=0))
