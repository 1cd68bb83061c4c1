"""The soak's clients: one coroutine per kind of request, each returning an ``Outcome``.

Kinds (``KINDS``, with their weights): greedy completions, streamed and not, checked token for
token against a greedy reference; sampled streams with ``n = 2``; streamed chat; best_of; clients
that disconnect mid-stream; bad requests (which must get a 4xx in OpenAI's error shape). Every
request has a deadline (``HANG_S``): one that passes it is *hung*.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import random
from dataclasses import dataclass, field

import aiohttp

HANG_S = 300.0
GREEDY_PROMPTS = [f"Chapter {i}. The old lighthouse keeper looked at the sea and" for i in range(16)]
MAX_TOKENS = 48


@dataclass
class Outcome:
    kind: str
    status: str  # "completed", "error" (a clear error), "refused" (503, retry), "rejected" (4xx, as
    # expected for a bad request), "disconnected" (on purpose), "unclear", "hung"
    detail: str = ""
    tokens_lost: int = 0  # greedy only: against the reference
    tokens_repeated: int = 0
    checked: bool = False  # compared with the greedy reference


@dataclass
class Soak:
    url: str
    model: str
    reference: dict[int, list[str]] = field(default_factory=dict)  # greedy prompt -> its tokens
    rng: random.Random = field(default_factory=lambda: random.Random(0))


async def _sse(resp: aiohttp.ClientResponse):
    """The JSON events of a server-sent event stream, until [DONE]."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[6:])


async def _post(session: aiohttp.ClientSession, soak: Soak, path: str, body: dict | bytes):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return session.post(f"{soak.url}{path}", data=data, headers={"Content-Type": "application/json"})


async def _http_error(resp: aiohttp.ClientResponse, kind: str) -> Outcome:
    try:
        message = (await resp.json())["error"]["message"]
    except (aiohttp.ContentTypeError, KeyError, json.JSONDecodeError, TypeError):
        return Outcome(kind, "unclear", f"HTTP {resp.status} without an error body")
    if resp.status == 503 and "Retry-After" in resp.headers:
        return Outcome(kind, "refused", message)
    return Outcome(kind, "error", f"HTTP {resp.status}: {message}")


def _compare(kind: str, got: list[str], expected: list[str]) -> Outcome:
    lost = repeated = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=expected, b=got, autojunk=False).get_opcodes():
        if op in ("delete", "replace"):
            lost += i2 - i1
        if op in ("insert", "replace"):
            repeated += j2 - j1
    return Outcome(kind, "completed", tokens_lost=lost, tokens_repeated=repeated, checked=True)


def greedy_body(soak: Soak, idx: int, stream: bool) -> dict:
    return {"model": soak.model, "prompt": GREEDY_PROMPTS[idx], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": stream}


async def greedy_tokens(session: aiohttp.ClientSession, soak: Soak, idx: int, stream: bool) -> list[str] | Outcome:
    """The tokens of one greedy completion, or the outcome that stopped it."""
    kind = f"greedy{'-stream' if stream else ''}"
    async with await _post(session, soak, "/v1/completions", greedy_body(soak, idx, stream)) as resp:
        if resp.status != 200:
            return await _http_error(resp, kind)
        if not stream:
            return (await resp.json())["choices"][0]["logprobs"]["tokens"]
        tokens = []
        async for event in _sse(resp):
            if "error" in event:
                return Outcome(kind, "error", event["error"]["message"])
            for choice in event.get("choices", []):
                tokens += (choice.get("logprobs") or {}).get("tokens", [])
        return tokens


async def greedy(session, soak: Soak, stream: bool) -> Outcome:
    idx = soak.rng.randrange(len(GREEDY_PROMPTS))
    got = await greedy_tokens(session, soak, idx, stream)
    if isinstance(got, Outcome):
        return got
    return _compare(f"greedy{'-stream' if stream else ''}", got, soak.reference[idx])


async def sampled_n(session, soak: Soak) -> Outcome:
    body = {"model": soak.model, "prompt": "Write a list of fruit:", "max_tokens": MAX_TOKENS, "n": 2,
            "temperature": 0.9, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with await _post(session, soak, "/v1/completions", body) as resp:
        if resp.status != 200:
            return await _http_error(resp, "sampled-n2")
        usage, ends = None, {}
        async for event in _sse(resp):
            if "error" in event:
                return Outcome("sampled-n2", "error", event["error"]["message"])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                if choice.get("finish_reason"):
                    ends[choice["index"]] = choice["finish_reason"]
    if ends != {0: "length", 1: "length"} or usage is None or usage["completion_tokens"] != 2 * MAX_TOKENS:
        return Outcome("sampled-n2", "unclear", f"ends {ends}, usage {usage}")
    return Outcome("sampled-n2", "completed")


async def chat(session, soak: Soak) -> Outcome:
    body = {"model": soak.model, "messages": [{"role": "user", "content": "Say something about boats."}],
            "max_tokens": MAX_TOKENS, "stream": True}
    async with await _post(session, soak, "/v1/chat/completions", body) as resp:
        if resp.status != 200:
            return await _http_error(resp, "chat-stream")
        finish = None
        async for event in _sse(resp):
            if "error" in event:
                return Outcome("chat-stream", "error", event["error"]["message"])
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
    return Outcome("chat-stream", "completed" if finish in ("stop", "length") else "unclear", str(finish))


async def best_of(session, soak: Soak) -> Outcome:
    body = {"model": soak.model, "prompt": "The best soup is", "max_tokens": 16, "n": 1, "best_of": 2,
            "temperature": 0.8}
    async with await _post(session, soak, "/v1/completions", body) as resp:
        if resp.status != 200:
            return await _http_error(resp, "best-of")
        ok = len((await resp.json())["choices"]) == 1
    return Outcome("best-of", "completed" if ok else "unclear")


async def disconnect(session, soak: Soak) -> Outcome:
    body = greedy_body(soak, soak.rng.randrange(len(GREEDY_PROMPTS)), stream=True)
    after = soak.rng.randint(1, 10)
    async with await _post(session, soak, "/v1/completions", body) as resp:
        if resp.status != 200:
            return await _http_error(resp, "disconnect")
        num = 0
        async for _ in _sse(resp):
            num += 1
            if num >= after:
                resp.close()  # the client goes away mid-stream
                return Outcome("disconnect", "disconnected")
    return Outcome("disconnect", "completed")


BAD_BODIES = [b'{"model": "m", "prompt": "hi", ', {"prompt": "hi", "max_tokens": -3},
              {"prompt": "hi", "temperature": "hot"}, {"prompt": "hi", "n": 0},
              {"model": "no-such-model", "prompt": "x"}]


async def bad_request(session, soak: Soak) -> Outcome:
    body = soak.rng.choice(BAD_BODIES)
    if isinstance(body, dict):
        body = {"model": soak.model, **body}
    async with await _post(session, soak, "/v1/completions", body) as resp:
        outcome = await _http_error(resp, "bad-request")
        if 400 <= resp.status < 500 and outcome.status == "error":
            return Outcome("bad-request", "rejected", outcome.detail)
        return Outcome("bad-request", "unclear", f"HTTP {resp.status}: {outcome.detail}")


KINDS = [  # (weight, coroutine)
    (25, lambda s, soak: greedy(s, soak, stream=True)),
    (15, lambda s, soak: greedy(s, soak, stream=False)),
    (15, sampled_n),
    (10, chat),
    (5, best_of),
    (15, disconnect),
    (15, bad_request),
]


async def one_request(session: aiohttp.ClientSession, soak: Soak) -> Outcome:
    weights, kinds = zip(*KINDS)
    kind = soak.rng.choices(kinds, weights=weights)[0]
    try:
        return await asyncio.wait_for(kind(session, soak), HANG_S)
    except asyncio.TimeoutError:
        return Outcome("?", "hung", f"no end within {HANG_S:.0f} s")
    except (aiohttp.ClientError, json.JSONDecodeError, KeyError) as exc:
        return Outcome("?", "unclear", repr(exc))
