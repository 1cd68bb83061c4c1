"""The frontend's flags, declared once (``shared.flag_spec``): the HTTP server's (``HttpFlags``),
its per-connection limits (``HttpLimits``, applied by ``http_limits`` and ``connection_guard``),
and ``add_frontend_arguments``, the ``frontend`` command's parser. ``pagedserve serve`` takes the
same flags and passes them on (``FRONTEND_FLAGS``: those the frontend takes).

Kept apart from the application so that every process's command-line parser (the launcher's,
the scheduler's, the executors') can define them without importing aiohttp: about 0.35 s of each
process's start here.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import ClassVar

from services.frontend.reasoning import PARSERS as REASONING_PARSERS
from services.frontend.tool_parsers import PARSER_NAMES
from shared.engine_flags import LivenessFlags, ModelFlags
POOLING_TYPES = ("last", "mean")
from shared.flag_spec import add_flags, declared, flag, from_args, option_strings


@dataclass(frozen=True, kw_only=True)
class HttpFlags:
    """The HTTP server: where it listens and what it serves."""

    TITLE: ClassVar[str] = "HTTP"

    host: str = flag("127.0.0.1", "address to listen on", eager=True)
    port: int = flag(8000, "HTTP port (0 picks a free one)", eager=True)
    served_model_name: str | None = flag(None, "the name clients put in 'model'", shown="the model's name")
    chat_template: str | None = flag(None, "a Jinja chat template for /v1/chat/completions, instead of the "
                                     "tokenizer's own: a file's path, or the template inline (a model without "
                                     "one answers chat requests 400)", shown="the tokenizer's")
    enable_auto_tool_choice: bool = flag(False, 'answer tool_choice "auto" (the default with tools): the model '
                                         "writes freely and its tool calls are parsed from the text by "
                                         "--tool-call-parser (off: \"auto\" answers 400)")
    tool_call_parser: str | None = flag(None, "the format the model writes tool calls in, for "
                                        "--enable-auto-tool-choice: hermes (Hermes, Qwen2.5, Qwen3), llama3_json, "
                                        "mistral or pythonic; left out, the chat template's: hermes when it writes "
                                        "tool_call tags, mistral [TOOL_CALLS], llama3_json Llama's python tag",
                                        choices=PARSER_NAMES, shown="the chat template's")
    generation_config: str = flag("auto", "sampling defaults for requests that leave them out (temperature, top_p, "
                                  "top_k, min_p, the penalties; max_new_tokens as chat's max_tokens): 'auto' the "
                                  "model's generation_config.json, as vLLM; 'vllm' none (OpenAI's defaults); or a "
                                  "directory holding that file, whose max_new_tokens also limits every request")
    reasoning_parser: str | None = flag(None, "split a reasoning model's thinking from its answer on chat: "
                                        "message.reasoning_content and delta.reasoning_content (the <think> family "
                                        "of DeepSeek-R1 and Qwen3, as vLLM's parsers of these names)",
                                        choices=REASONING_PARSERS, shown="none")
    pooling_type: str = flag("last", "how /v1/embeddings, /v1/rerank and /v1/score pool a prompt's final hidden "
                             "states into one vector (then L2-normalized): last, the last token's (Qwen3-Embedding, "
                             "e5-mistral), or mean, their mean (vLLM's PoolerConfig.pooling_type)",
                             choices=POOLING_TYPES)
    max_queue_len: int | None = flag(None, "most requests waiting for their first token; more get a 503", type=int,
                                     shown="no limit")
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY' on every route but /health (or set "
                               "PAGEDSERVE_API_KEY or PAGEDSERVE_API_KEY_FILE, which keep the key off the command "
                               "lines; serve hands it to the frontend in its environment)", shown="no key",
                               on_argv=False)
    playground: bool = flag(True, "serve the chat playground at / and the block-pool events at /v1/kv/events "
                            "(--no-playground: do not)", off=("--no-playground",), eager=True)


def _limit(default: float | int, help: str, name: str):
    return flag(default, help, dest=f"http_{name}")


@dataclass(frozen=True, kw_only=True)
class HttpLimits:
    """Per-connection deadlines (seconds) and the cap on open connections; validated on construction."""

    TITLE: ClassVar[str] = "HTTP limits"

    header_timeout_s: float = _limit(20.0, "close a connection whose request headers are not complete this long "
                                     "after their first byte (a 408 is sent)", "header_timeout_s")
    body_timeout_s: float = _limit(60.0, "answer 408 when a request body has not fully arrived in this time",
                                   "body_timeout_s")
    keepalive_timeout_s: float = _limit(75.0, "close a connection idle between requests for this long (longer "
                                        "than common proxies' 60 s)", "keepalive_timeout_s")
    write_timeout_s: float = _limit(30.0, "drop a client that reads nothing of its response for this long (its "
                                    "request is aborted)", "write_timeout_s")
    max_connections: int = _limit(4096, "most open HTTP connections; more get a 503 and are closed",
                                  "max_connections")

    def __post_init__(self) -> None:
        for f, spec in declared(HttpLimits):
            value = getattr(self, f.name)
            if isinstance(f.default, int):
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
                want = "an integer of at least 1"
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                    and value > 0
                want = "a positive number of seconds"
            if not ok:
                raise ValueError(f"{option_strings(f, spec)[0]} must be {want}, got {value!r}")


# The flags the frontend takes, by declaring class (None: all of its flags); serve passes them on.
FRONTEND_FLAGS = ((ModelFlags, None), (HttpFlags, None), (HttpLimits, None), (LivenessFlags, ("heartbeat_timeout",)))


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """``HttpLimits`` from parsed flags; flags not given keep the defaults. Raises ``ValueError``."""
    return from_args(args, HttpLimits)


def add_frontend_arguments(parser: argparse.ArgumentParser, *, endpoint_flags: bool = True) -> None:
    """Add the frontend's flags. ``endpoint_flags=False`` leaves out --request-endpoint, for a
    launcher that creates the endpoints itself."""
    for cls, only in FRONTEND_FLAGS:
        add_flags(parser.add_argument_group(cls.TITLE), cls, only)
    if endpoint_flags:
        from shared.zmq_auth import add_curve_argument  # imports zmq, which `pagedserve health` must not

        group = parser.add_argument_group("endpoints and security")
        group.add_argument("--request-endpoint", default=None,
                           help="the scheduler's ZMQ endpoint for frontends: requests go there, their outputs "
                                "come back from it; several separated by commas: data-parallel replicas, each "
                                "request routed to one (env PAGEDSERVE_REQUEST_ENDPOINT)")
        add_curve_argument(group)
