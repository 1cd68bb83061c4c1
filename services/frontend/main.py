"""Entry points: ``run_frontend`` (the process) and the command-line flags that configure it."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys

import structlog
import uvloop
from aiohttp import web

from services.frontend.app import create_app
from services.frontend.chat_template import resolve_chat_template
from services.frontend.config import FrontendConfig
from services.frontend.connection_guard import ConnectionGuard, GuardedSite
from services.frontend.engine_client import EngineClient
from services.frontend.replicas import Replicas
from services.frontend.flags import HttpFlags, add_frontend_arguments, http_limits_from_args
from services.frontend.served_model import ServedModel, load_served_model
from shared.endpoints import Endpoints
from shared.engine_flags import ModelFlags
from shared.flag_spec import given
from shared.logging import configure_logging
from shared.restart_counts import ENV_VAR as RESTARTS_ENV_VAR
from shared.zmq_auth import CurveKeys, curve_dir, load_keys, log_mode

log = structlog.get_logger()

# How long running requests may take to finish once shutdown starts; then they are cancelled (and
# so aborted at the scheduler). Other handlers get aiohttp's own timeout on top.
SHUTDOWN_GRACE_S = 5.0
HANDLER_SHUTDOWN_TIMEOUT_S = 1.0


class FrontendServer:
    """The frontend application listening on ``config.host:config.port`` in the running loop."""

    def __init__(self, config: FrontendConfig, model: ServedModel, shutdown_grace_s: float = SHUTDOWN_GRACE_S,
                 curve: CurveKeys | None = None) -> None:
        self.config = config
        self.model = model
        self.client = engine_link(config, curve)
        self.app = create_app(
            model, self.client, max_body_bytes=config.max_body_bytes, shutdown_grace_s=shutdown_grace_s,
            max_queue_len=config.max_queue_len, api_key=config.api_key, http_limits=config.http_limits,
            playground=config.playground, restarts_file=config.restarts_file,
        )
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=HANDLER_SHUTDOWN_TIMEOUT_S
        )
        self.guard = ConnectionGuard(config.http_limits)
        self._watchdog: asyncio.Task | None = None
        self.port: int | None = None

    async def start(self) -> None:
        await self._runner.setup()
        site = GuardedSite(self._runner, self.config.host, self.config.port, self.guard, access_log=None)
        await site.start()
        self._watchdog = asyncio.create_task(self.guard.watch(), name="connection-guard")
        self.port = self._runner.addresses[0][1]
        log.info("frontend listening", host=self.config.host, port=self.port, model=self.model.name,
                 max_body_bytes=self.config.max_body_bytes or self.model.body_limit_bytes,
                 max_connections=self.guard.max_connections)

    async def stop(self) -> None:
        """Stop accepting, let requests finish (``SHUTDOWN_GRACE_S``), then close the ZMQ sockets.
        The connection guard keeps watching meanwhile (a client that does not read cannot hold it)."""
        try:
            await self._runner.cleanup()
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()


def engine_link(config: FrontendConfig, curve: CurveKeys | None = None) -> EngineClient | Replicas:
    """The client of the scheduler, or with several request endpoints (data-parallel replicas)
    one client per scheduler behind a router."""
    clients = [EngineClient(dataclasses.replace(config.endpoints, request=endpoint),
                            heartbeat_timeout_s=config.heartbeat_timeout, curve=curve)
               for endpoint in config.request_endpoints]
    return clients[0] if len(clients) == 1 else Replicas(clients)


async def serve_until_signal(config: FrontendConfig, model: ServedModel, curve: CurveKeys | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    server = FrontendServer(config, model, curve=curve)
    await server.start()
    try:
        await stop.wait()
        log.info("shutting down frontend")
    finally:
        await server.stop()
    log.info("frontend stopped")


def run_frontend(config: FrontendConfig) -> None:
    """Run the frontend process until SIGTERM or SIGINT: load the tokenizer, serve, shut down."""
    configure_logging("frontend")
    # Every line of this process says which process it came from (request ids are bound per task).
    structlog.contextvars.bind_contextvars(process="frontend", pid=os.getpid())
    log.info("starting frontend", model=config.model or "default", request_endpoint=config.endpoints.request)
    curve = load_keys(config.zmq_curve, "frontend") if config.zmq_curve else None  # before the slow part
    log_mode(log, curve)
    try:
        model = load_served_model(config)
    except ValueError as exc:  # a flag the model cannot go with: one line, not a traceback
        raise SystemExit(f"pagedserve frontend: {exc}") from None
    log.info("model ready", served_model_name=model.name, max_model_len=model.max_model_len,
             eos_token_ids=model.eos_token_ids, max_token_chars=model.max_token_chars)
    uvloop.run(serve_until_signal(config, model, curve))


def frontend_config_from_args(args: argparse.Namespace, endpoints: Endpoints | None = None) -> FrontendConfig:
    """Build the config from parsed flags; ``endpoints``, when given, wins over the endpoint flags.
    Raises ``ValueError`` naming the bad flag."""
    if endpoints is None:
        endpoints = Endpoints(
            request=getattr(args, "request_endpoint", None) or os.environ.get("PAGEDSERVE_REQUEST_ENDPOINT", ""),
            step=os.environ.get("PAGEDSERVE_STEP_ENDPOINT", ""),  # not used by the frontend
            result=os.environ.get("PAGEDSERVE_RESULT_ENDPOINT", ""),  # not used by the frontend
        )
    values = {**given(args, ModelFlags), **given(args, HttpFlags)}
    if getattr(args, "heartbeat_timeout", None):  # 0 or not given: the default
        values["heartbeat_timeout"] = args.heartbeat_timeout
    for name in ("model", "tokenizer", "generation_config"):  # empty: not given
        if not values.get(name, True):
            del values[name]
    api_key, template = values.pop("api_key", None), values.pop("chat_template", None)
    return FrontendConfig(
        **values, endpoints=endpoints, api_key=api_key or api_key_from_env(),
        chat_template=resolve_chat_template(template), http_limits=http_limits_from_args(args),
        zmq_curve=curve_dir(args),
        restarts_file=os.environ.get(RESTARTS_ENV_VAR) or None,
    )


def api_key_from_env() -> str | None:
    """``PAGEDSERVE_API_KEY``, else the contents of the file ``PAGEDSERVE_API_KEY_FILE`` names (a
    compose secret; one trailing newline dropped), else None. Keys travel this way, never on argv."""
    key = os.environ.get("PAGEDSERVE_API_KEY")
    path = os.environ.get("PAGEDSERVE_API_KEY_FILE")
    if key or not path:
        return key or None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().removesuffix("\n").removesuffix("\r") or None
    except OSError as exc:
        raise ValueError(f"PAGEDSERVE_API_KEY_FILE: cannot read {path}: {exc.strerror or exc}") from None


def main(argv: list[str] | None = None) -> None:
    """``python -m services.frontend.main``: the frontend on its own."""
    parser = argparse.ArgumentParser(prog="pagedserve-frontend", description="pagedserve's OpenAI-compatible frontend")
    add_frontend_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = frontend_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    run_frontend(config)


if __name__ == "__main__":
    sys.exit(main())
