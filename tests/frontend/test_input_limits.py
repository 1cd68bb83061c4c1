"""Input sizes checked before tokenizing, and tokenizing that cannot hold up small requests (real
frontend, fake scheduler; the served model claims a 128k context so that big prompts get past
the body limit).

Latencies are compared within one run (a small request alone, then while big ones are in flight);
the bound is the issue's one second, far below what a shared tokenizer thread used to cost.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import aiohttp
import pytest

from services.frontend.input_limits import (
    JSON_BYTES_PER_CHAR, MIN_BODY_BYTES, body_limit_bytes, longest_token_chars, max_prompt_chars,
)
from tests.doubles.fake_scheduler import FrontendThread, default_served_model
from tests.doubles.http import http

MAX_MODEL_LEN = 131072
SMALL_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def test_longest_token_bounds_every_token(model):
    """Every token's text is at most ``max_token_chars`` long: the bound behind the character check."""
    tokenizer = model.tokenizer
    assert model.max_token_chars == longest_token_chars(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    assert max(len(t) for t in texts) <= model.max_token_chars
    assert model.max_prompt_chars == MAX_MODEL_LEN * model.max_token_chars
    assert body_limit_bytes(MAX_MODEL_LEN, model.max_token_chars) == JSON_BYTES_PER_CHAR * model.max_prompt_chars
    assert body_limit_bytes(16, 4) == MIN_BODY_BYTES


async def _timed_post(session: aiohttp.ClientSession, url: str, body: object) -> tuple[int, dict, float]:
    started = time.monotonic()
    async with session.post(url, data=json.dumps(body).encode(),
                            headers={"Content-Type": "application/json"}) as resp:
        payload = await resp.json()
        return resp.status, payload, time.monotonic() - started


@pytest.mark.slow  # tokenizes megabyte prompts
def test_big_prompts_do_not_hold_up_small_requests(frontend, fake, model):
    """A 30 MB prompt is refused on its characters, untokenized; a 3M-character prompt (under that
    limit) is tokenized on its own thread; one-token chats sent meanwhile are not held up."""
    url = frontend.base_url + "/v1/chat/completions"
    huge = "word " * 6_000_000  # 30 MB
    big = "lorem ipsum dolor sit amet " * 111_112  # 3M characters, about 1M tokens: tokenized, then a 400
    assert len(huge) > model.max_prompt_chars > len(big)

    async def go():
        async with aiohttp.ClientSession() as session:
            alone = [(await _timed_post(session, url, SMALL_CHAT))[2] for _ in range(3)]
            num_added = len(fake.added)
            huge_task = asyncio.ensure_future(_timed_post(session, url, {"messages": [
                {"role": "user", "content": huge}]}))
            big_task = asyncio.ensure_future(_timed_post(session, url, {"messages": [
                {"role": "user", "content": big}]}))
            # The huge one is refused once its body is parsed (on the event loop: 0.18 s here when quiet,
            # 1.2 s beside a busy neighbour, when a small request sent then waited as long); the small
            # requests are timed from then on, while the big one is tokenized on its thread.
            huge_result = await huge_task
            await asyncio.sleep(0.1)  # the big one's body parsed too
            during = []  # small requests sent while the big one is in flight
            while not big_task.done():
                status, _, seconds = await _timed_post(session, url, SMALL_CHAT)
                assert status == 200
                during.append(seconds)
                await asyncio.sleep(0.05)
            return alone, during, huge_result, await big_task, len(fake.added) - num_added - len(during)

    alone, during, huge_result, big_result, num_added = asyncio.run(go())
    status, payload, _ = huge_result
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded"
    message = payload["error"]["message"]
    assert f"{len(huge)} characters" in message and f"{model.max_prompt_chars} characters" in message
    status, payload, _ = big_result
    assert status == 400 and payload["error"]["code"] == "context_length_exceeded"
    assert "tokens" in payload["error"]["message"] and "characters" not in payload["error"]["message"]
    assert num_added == 0  # neither big prompt reached the engine
    assert during, "the big prompt was done before any small request was sent beside it"
    assert max(during) < statistics.median(alone) + 1.0, (alone, during)


@pytest.fixture
def short_context(fake):
    """A second frontend on the same fake, serving a 4096-token context (no generation here)."""
    server = FrontendThread(default_served_model(max_model_len=4096), fake.endpoints).start()
    yield server
    server.stop()


def test_body_limit_follows_max_model_len(short_context):
    model = short_context.model
    limit = model.body_limit_bytes
    assert limit == JSON_BYTES_PER_CHAR * 4096 * model.max_token_chars > MIN_BODY_BYTES
    status, _, raw = http("POST", short_context.base_url + "/v1/completions", data=b" " * (limit + 1))
    error = json.loads(raw)["error"]
    assert status == 413 and "max_model_len 4096" in error["message"]
    # A body under the limit whose prompt has too many characters: refused before tokenizing.
    too_long = "x" * (max_prompt_chars(4096, model.max_token_chars) + 1)
    for path, body, param in [("/v1/completions", {"prompt": too_long}, "prompt"),
                              ("/v1/completions", {"prompt": ["ok", too_long]}, "prompt"),
                              ("/tokenize", {"prompt": too_long}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "user", "content": too_long}]}, "messages")]:
        status, _, raw = http("POST", short_context.base_url + path, body=body)
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == param and "characters" in error["message"], (path, error)
    # At the limit exactly, the prompt is tokenized (and is then too long in tokens).
    tokens = model.tokenizer.convert_ids_to_tokens(list(range(model.vocab_size)))
    longest = max(range(len(tokens)), key=lambda i: len(tokens[i]) if tokens[i] else 0)
    at_limit = model.tokenizer.decode([longest] * 4096)
    assert len(at_limit) <= max_prompt_chars(4096, model.max_token_chars)
    status, _, raw = http("POST", short_context.base_url + "/v1/completions", body={"prompt": at_limit})
    error = json.loads(raw)["error"]
    assert status == 400 and "tokens" in error["message"] and "characters" not in error["message"]
