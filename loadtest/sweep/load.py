"""Open-loop load for the rate sweep: one request stream, Poisson arrivals, streamed completions, and
``/health`` sampled while they run.

``build_workload`` draws every request's prompt and output lengths once, from the ShareGPT- or
Alpaca-like distribution of ``loadtest/common/workloads.py`` for the model's full context, then shrinks
both by ``scale`` (and the context with them). ``arrival_times_s`` turns one stream of unit-mean
exponential gaps into arrival times at any rate, so every rate and every policy replays the same
requests in the same order, only faster or slower. Prompts are token ids, drawn afresh per rate
(an earlier rate's blocks must not be found in the prefix cache), optionally after a prefix that
every request shares.

``run_rate`` sends each request at its arrival time whether or not earlier ones have finished
(an open loop, like the paper's Poisson clients), streams it and records when its first and last
tokens came. A request's length holds in one of two ways (``Reservation``): ``exact`` asks for
``max_tokens`` = its output length with ``ignore_eos``; ``pow2`` and ``max`` ask for more (the next
power of two, or the rest of the context: what a reservation-based server must then hold for
it, like the paper's Orca (Pow2) and Orca (Max)) and the client closes the stream once the output
length has arrived; the server aborts the rest. Tokens are counted, and their arrival times kept,
from the stream's per-token logprobs (``logprobs: 0``), in every mode alike.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from loadtest.common.workloads import DATASETS

RESERVATIONS = ("exact", "pow2", "max")
TOKEN_ID_RANGE = (100, 32_000)  # inside every Llama-family vocabulary (SmolLM2's is 49,152)


@dataclass(frozen=True)
class Workload:
    """The requests' lengths, in arrival order, and the context they were scaled into."""

    num_prompt_tokens: list[int]
    num_output_tokens: list[int]
    gaps: list[float]  # unit-mean exponential; gap i precedes request i (gap 0 is unused)
    max_model_len: int  # the scaled context: every prompt + output fits

    def __len__(self) -> int:
        return len(self.num_prompt_tokens)


def scaled_context(max_model_len: int, scale: float) -> int:
    return max(2, round(max_model_len * scale))


def build_workload(dataset: str, num_requests: int, seed: int, max_model_len: int, scale: float) -> Workload:
    """Lengths drawn for ``max_model_len`` (no template overhead: prompts are token ids), then both
    multiplied by ``scale``, rounded, at least 1, and clipped so prompt + output fits the scaled context."""
    rng = random.Random(seed)
    context = scaled_context(max_model_len, scale)
    prompts, outputs = [], []
    for _ in range(num_requests):
        num_input, num_output = DATASETS[dataset].sample(rng, max_model_len, overhead_tokens=0)
        num_input = min(context - 1, max(1, round(num_input * scale)))
        prompts.append(num_input)
        outputs.append(min(context - num_input, max(1, round(num_output * scale))))
    gap_rng = random.Random(seed + 1)
    gaps = [gap_rng.expovariate(1.0) for _ in range(num_requests)]
    return Workload(prompts, outputs, gaps, context)


def arrival_times_s(workload: Workload, num_requests: int, rate_req_s: float) -> list[float]:
    """Poisson arrivals at ``rate_req_s`` for the first ``num_requests``: the first at 0."""
    times, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += workload.gaps[i] / rate_req_s
        times.append(t)
    return times


def max_tokens_for(reservation: str, num_prompt_tokens: int, num_output_tokens: int, max_model_len: int) -> int:
    """What the request asks for: its output length (``exact``), the next power of two at or above
    it (``pow2``), or the rest of the context (``max``), never past the context."""
    room = max_model_len - num_prompt_tokens
    if reservation == "exact":
        return num_output_tokens
    if reservation == "pow2":
        return min(room, 1 << math.ceil(math.log2(num_output_tokens)))
    if reservation == "max":
        return room
    raise ValueError(f"reservation {reservation!r} is not one of {', '.join(RESERVATIONS)}")


def prompt_ids(workload: Workload, num_requests: int, seed: int, rate_req_s: float,
               num_shared_prefix_tokens: int) -> list[list[int]]:
    """Token-id prompts of the workload's lengths, random per (seed, rate); each starts with up to
    ``num_shared_prefix_tokens`` ids that every request (at every rate) shares."""
    prefix_rng = random.Random(f"shared prefix {seed}")
    prefix = [prefix_rng.randrange(*TOKEN_ID_RANGE) for _ in range(num_shared_prefix_tokens)]
    rng = random.Random(f"prompts {seed} {rate_req_s}")
    prompts = []
    for n in workload.num_prompt_tokens[:num_requests]:
        head = prefix[:n]
        prompts.append(head + [rng.randrange(*TOKEN_ID_RANGE) for _ in range(n - len(head))])
    return prompts


@dataclass
class RequestRecord:
    """One request's times, in seconds from the run's start."""

    arrival_s: float
    num_output_tokens_expected: int
    sent_s: float | None = None
    first_token_s: float | None = None
    done_s: float | None = None
    num_output_tokens: int = 0
    token_times_s: list[float] = field(default_factory=list)  # when each output token arrived
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None

    @property
    def e2e_s(self) -> float:
        return self.done_s - self.sent_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.sent_s


@dataclass
class HealthSample:
    """What ``/health`` said at ``t_s`` (None: the field was missing)."""

    t_s: float
    num_running: int | None
    num_waiting: int | None
    num_blocks_used: int | None
    num_blocks_total: int | None
    num_slots_used: int | None
    num_slots_allocated: int | None
    num_preemptions: int | None

    @classmethod
    def from_health(cls, t_s: float, body: dict) -> HealthSample:
        return cls(t_s, *(body.get(name) for name in (
            "num_running", "num_waiting", "num_blocks_used", "num_blocks_total", "num_slots_used",
            "num_slots_allocated", "num_preemptions")))


@dataclass
class RatePlan:
    """Everything one timed run sends."""

    url: str
    model: str
    prompts: list[list[int]]
    arrivals_s: list[float]
    num_output_tokens: list[int]
    max_tokens: list[int]
    client_stops: bool  # False: the server stops each request (exact); True: the client closes the stream
    sample_interval_s: float = 0.5
    progress_interval_s: float = 10.0
    records: list[RequestRecord] = field(default_factory=list)
    samples: list[HealthSample] = field(default_factory=list)


async def run_rate(plan: RatePlan, progress: Callable[[RatePlan, float], None]) -> None:
    """Send ``plan``'s requests at their arrival times, fill ``plan.records`` and ``plan.samples``;
    ``progress(plan, elapsed_s)`` is called every ``progress_interval_s`` and once at the end."""
    plan.records = [RequestRecord(a, n) for a, n in zip(plan.arrivals_s, plan.num_output_tokens)]
    connector = aiohttp.TCPConnector(limit=0)  # an open loop: never queue requests in the client
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.monotonic()
        clock = lambda: time.monotonic() - t0  # noqa: E731
        plan.samples.append(HealthSample.from_health(0.0, await _get_health(session, plan.url)))
        stop = asyncio.Event()
        watchers = [asyncio.create_task(_sample(session, plan, clock, stop)),
                    asyncio.create_task(_report(plan, clock, stop, progress))]
        await asyncio.gather(*(_send(session, plan, i, clock) for i in range(len(plan.records))))
        stop.set()
        await asyncio.gather(*watchers)
        plan.samples.append(HealthSample.from_health(clock(), await _get_health(session, plan.url)))
        progress(plan, clock())


async def _send(session, plan: RatePlan, i: int, clock: Callable[[], float]) -> None:
    record = plan.records[i]
    await asyncio.sleep(max(0.0, record.arrival_s - clock()))
    # logprobs 0: every chunk lists its tokens, so the client counts them exactly (a chunk's text
    # can hold several tokens, or none while the detokenizer waits for a whole character)
    body = {"model": plan.model, "prompt": plan.prompts[i], "max_tokens": plan.max_tokens[i], "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True}
    record.sent_s = clock()
    try:
        async with session.post(f"{plan.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            await read_events(resp, record, plan.client_stops, clock)
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        record.error = record.error or f"{type(exc).__name__}: {exc}"


async def read_events(resp, record: RequestRecord, client_stops: bool, clock: Callable[[], float]) -> None:
    """Consume the server-sent events into ``record``; with ``client_stops``, close the stream once
    the expected tokens have arrived."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            record.done_s = clock()
            break
        chunk = json.loads(data)
        if "error" in chunk:
            record.error = str(chunk["error"].get("message", chunk["error"]))
            return
        num_tokens = sum(len((c.get("logprobs") or {}).get("tokens") or ()) for c in chunk.get("choices") or ())
        if num_tokens:
            now = clock()
            record.first_token_s = record.first_token_s if record.first_token_s is not None else now
            record.token_times_s.extend([now] * num_tokens)
        if client_stops and len(record.token_times_s) >= record.num_output_tokens_expected:
            # a chunk can carry several tokens (outputs of several steps sent at once): the request
            # ended with its last expected token, and what came with it is dropped
            del record.token_times_s[record.num_output_tokens_expected:]
            record.done_s = record.token_times_s[-1]
            resp.close()  # the server sees the client go and aborts the rest
            break
    record.num_output_tokens = len(record.token_times_s)
    if record.done_s is None:
        record.error = "the stream ended without data: [DONE]"
    elif record.num_output_tokens != record.num_output_tokens_expected:
        record.error = f"{record.num_output_tokens} output tokens, expected {record.num_output_tokens_expected}"


async def _get_health(session, url: str) -> dict:
    try:
        async with session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return await resp.json()
    except (aiohttp.ClientError, OSError, ValueError):
        return {}


async def _sample(session, plan: RatePlan, clock: Callable[[], float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        t_s = clock()
        plan.samples.append(HealthSample.from_health(t_s, await _get_health(session, plan.url)))
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, t_s + plan.sample_interval_s - clock()))
        except asyncio.TimeoutError:
            pass


async def _report(plan: RatePlan, clock: Callable[[], float], stop: asyncio.Event,
                  progress: Callable[[RatePlan, float], None]) -> None:
    while True:
        try:
            await asyncio.wait_for(stop.wait(), plan.progress_interval_s)
            return
        except asyncio.TimeoutError:
            progress(plan, clock())
