"""What every route of the frontend shares: the application's state and the request keys."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from services.frontend.engine_client import EngineClient
from services.frontend.logprobs import TokenFormatter
from services.frontend.metrics import FrontendMetrics
from services.frontend.served_model import ServedModel


@dataclass
class FrontendState:
    """One application's model, engine link, metrics and limits (see ``app.create_app``)."""

    model: ServedModel
    client: EngineClient
    # Tokenization runs off the event loop, on one thread (HF tokenizers are not thread-safe).
    tokenizer_pool: ThreadPoolExecutor
    metrics: FrontendMetrics
    token_formatter: TokenFormatter
    max_queue_len: int | None = None
    api_key: str | None = None
    # Handler tasks with a request at the scheduler, so that shutdown can end them (and abort).
    generating: set[asyncio.Task] = field(default_factory=set)
    shutdown_grace_s: float = 5.0

    async def tokenize(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)


STATE = web.AppKey("state", FrontendState)
REQUEST_ID = web.RequestKey("request_id", str)
