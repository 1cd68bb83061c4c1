"""The frontend's command-line flags (``add_frontend_arguments``), among them those that
``pagedserve serve`` also takes and passes on: the HTTP limits (``HttpLimits``, applied by
``http_limits`` and ``connection_guard``) and the playground switch.

Kept apart from the application so that every process's command-line parser (the launcher's,
the scheduler's, the executors') can define them without importing aiohttp: about 0.35 s of each
process's start here.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Callable

from shared.zmq_auth import add_curve_argument


@dataclass(frozen=True, kw_only=True)
class HttpLimits:
    """Per-connection deadlines (seconds) and the cap on open connections; validated on construction."""

    header_timeout_s: float = 20.0  # from a request's first byte to the end of its headers
    body_timeout_s: float = 60.0  # for the whole body, once the handler reads it
    keepalive_timeout_s: float = 75.0  # idle between requests (longer than common proxies' 60 s)
    write_timeout_s: float = 30.0  # writes blocked on a client that does not read
    max_connections: int = 4096  # more are answered 503 and closed at once

    def __post_init__(self) -> None:
        for spec in HTTP_LIMIT_FLAGS:
            value = getattr(self, spec.field)
            if spec.kind is int:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
                want = "an integer of at least 1"
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                    and value > 0
                want = "a positive number of seconds"
            if not ok:
                raise ValueError(f"{spec.flag} must be {want}, got {value!r}")


@dataclass(frozen=True)
class _FlagSpec:
    field: str  # HttpLimits' field
    kind: Callable[[str], float | int]
    help: str

    @property
    def dest(self) -> str:
        return f"http_{self.field}"

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")


HTTP_LIMIT_FLAGS = (
    _FlagSpec("header_timeout_s", float, "close a connection whose request headers are not complete this long "
                                         "after their first byte (a 408 is sent)"),
    _FlagSpec("body_timeout_s", float, "answer 408 when a request body has not fully arrived in this time"),
    _FlagSpec("keepalive_timeout_s", float, "close a connection idle between requests for this long"),
    _FlagSpec("write_timeout_s", float, "drop a client that reads nothing of its response for this long "
                                        "(its request is aborted)"),
    _FlagSpec("max_connections", int, "most open HTTP connections; more get a 503 and are closed"),
)
HTTP_LIMIT_DESTS = tuple(spec.dest for spec in HTTP_LIMIT_FLAGS)  # argparse names, for the launcher


def add_http_limit_arguments(group: argparse._ArgumentGroup) -> None:
    """The ``--http-*`` flags (default ``None``: ``HttpLimits``' own default, shown in the help)."""
    defaults = HttpLimits()
    for spec in HTTP_LIMIT_FLAGS:
        group.add_argument(spec.flag, type=spec.kind, default=None,
                           help=f"{spec.help} (default {getattr(defaults, spec.field)})")


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """``HttpLimits`` from parsed flags; flags not given keep the defaults. Raises ``ValueError``."""
    given = {spec.field: getattr(args, spec.dest, None) for spec in HTTP_LIMIT_FLAGS}
    return HttpLimits(**{name: value for name, value in given.items() if value is not None})


def add_playground_argument(group: argparse._ActionsContainer) -> None:
    group.add_argument("--no-playground", dest="playground", action="store_false", default=True,
                       help="do not serve the chat playground at / nor the block-pool events at /v1/kv/events")


def add_chat_template_argument(group: argparse._ActionsContainer) -> None:
    group.add_argument("--chat-template", default=None,
                       help="a Jinja chat template for /v1/chat/completions, instead of the tokenizer's own: a "
                            "file's path, or the template inline (default: the tokenizer's; a model without "
                            "one answers chat requests 400)")


def add_tokenizer_argument(group: argparse._ActionsContainer) -> None:
    group.add_argument("--tokenizer", default=None,
                       help="where the tokenizer comes from, if not from --model: a directory with a tokenizer's "
                            "files, or a .gguf file (default: the model's)")


def add_generation_config_argument(group: argparse._ActionsContainer) -> None:
    group.add_argument("--generation-config", default=None,
                       help="sampling defaults for requests that leave them out (temperature, top_p, top_k, min_p, "
                            "the penalties; max_new_tokens as chat's max_tokens): 'auto' the model's "
                            "generation_config.json, as vLLM; 'vllm' none (OpenAI's defaults); or a directory "
                            "holding that file, whose max_new_tokens also limits every request (default: auto)")


def add_frontend_arguments(parser: argparse.ArgumentParser, *, endpoint_flags: bool = True) -> None:
    """Add the frontend's flags. ``endpoint_flags=False`` leaves out --request-endpoint, for a
    launcher that creates the endpoints itself."""
    group = parser.add_argument_group("frontend")
    group.add_argument("--model", default=None,
                       help="model directory, .gguf file, or empty for the embedded SmolLM2-135M-Instruct")
    group.add_argument("--served-model-name", default=None,
                       help="the name clients put in 'model' (default: the model's name)")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="most prompt + completion tokens per request (default: the model's context length)")
    add_tokenizer_argument(group)
    add_chat_template_argument(group)
    add_generation_config_argument(group)
    group.add_argument("--max-queue-len", type=int, default=None,
                       help="most requests waiting for their first token; more get a 503 (default: no limit)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health (default: env "
                            "PAGEDSERVE_API_KEY, else the file named by PAGEDSERVE_API_KEY_FILE, else no key)")
    group.add_argument("--heartbeat-timeout", type=float, default=None,
                       help="seconds without a word from the scheduler before it counts as lost: /health and "
                            "new requests answer 503 until it is back (default 10)")
    add_http_limit_arguments(group)
    add_playground_argument(group)
    if endpoint_flags:
        group.add_argument("--request-endpoint", default=os.environ.get("PAGEDSERVE_REQUEST_ENDPOINT"),
                           help="the scheduler's ZMQ endpoint for frontends: requests go there, their outputs "
                                "come back from it; several separated by commas: data-parallel replicas, each "
                                "request routed to one (env PAGEDSERVE_REQUEST_ENDPOINT)")
        add_curve_argument(group)
