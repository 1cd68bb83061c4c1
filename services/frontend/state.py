"""What every route of the frontend shares: the application's state and the request keys."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from services.frontend.engine_client import EngineClient
from services.frontend.replicas import Replicas
from services.frontend.logprobs import TokenFormatter
from services.frontend.metrics import FrontendMetrics
from services.frontend.served_model import ServedModel
from services.frontend.tokenizer_pools import TokenizerPools


@dataclass
class FrontendState:
    """One application's model, engine link, metrics and limits (see ``app.create_app``)."""

    model: ServedModel
    client: EngineClient | Replicas  # one scheduler, or several (-dp)
    # Tokenization runs off the event loop, big inputs apart from small ones.
    tokenizer_pools: TokenizerPools
    metrics: FrontendMetrics
    token_formatter: TokenFormatter
    # Restarts by process, as /metrics and /health report them (``metrics``; ``app.create_app``).
    process_restarts: Callable[[], dict[str, int]]
    max_queue_len: int | None = None
    api_key: str | None = None
    # Handler tasks with a request at the scheduler, so that shutdown can end them (and abort).
    generating: set[asyncio.Task] = field(default_factory=set)
    shutdown_grace_s: float = 5.0

    async def tokenize(self, num_chars: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a tokenizer thread; ``num_chars``, the input's size, picks the pool."""
        return await self.tokenizer_pools.run(num_chars, fn, *args)


STATE = web.AppKey("state", FrontendState)
REQUEST_ID = web.RequestKey("request_id", str)
