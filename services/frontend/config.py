"""The frontend's configuration: what the operator chose, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.frontend.flags import HttpFlags, HttpLimits
from services.frontend.generation_defaults import check_setting
from services.frontend.reasoning import PARSERS as REASONING_PARSERS
from shared.endpoints import Endpoints
from shared.engine_flags import LivenessFlags

_HTTP, _LIVENESS = HttpFlags(), LivenessFlags()  # the flags' defaults, declared there once

_ENDPOINT_SCHEMES = ("ipc://", "tcp://", "inproc://")


@dataclass(frozen=True, kw_only=True)
class FrontendConfig:
    """Settings of one frontend process.

    ``model`` is a ``--model`` value for ``shared.model_source.resolve_model`` (``None``: the
    embedded SmolLM2). ``served_model_name`` is what clients must put in ``"model"`` (default: the
    model's own name). ``max_model_len`` caps prompt + completion tokens (default: the model's
    ``max_position_embeddings``). Only ``endpoints.request`` is used: one scheduler's endpoint, or
    several separated by commas (data-parallel replicas; ``request_endpoints``).
    ``max_body_bytes`` caps a request body (a larger one gets a 413; ``None``: sized from
    ``max_model_len``, see ``input_limits.body_limit_bytes``). ``http_limits``: the HTTP server's
    timeouts and connection cap. ``max_queue_len`` caps the
    engine requests waiting for their first output (more get a 503 with ``Retry-After``; ``None``:
    no cap). ``api_key``: when set, every route but /health needs ``Authorization: Bearer <key>``.
    ``playground``: serve the chat page at / and /v1/kv/events (``--no-playground``: not).
    ``zmq_curve``: the ``--zmq-curve`` key directory (``shared.zmq_auth``; None: plain ZeroMQ).
    ``restarts_file``: the launcher's restart counts (``shared.restart_counts``; None: no launcher).
    ``chat_template``: the Jinja text chat requests are rendered with instead of the tokenizer's
    (``--chat-template``, resolved by ``chat_template.resolve_chat_template``; None: the tokenizer's).
    ``generation_config``: where requests' sampling defaults come from (``--generation-config``:
    auto, vllm or a directory; ``generation_defaults``). ``tokenizer``: ``--tokenizer``, where the
    tokenizer comes from when not from the model (``shared.model_source.resolve_tokenizer``).
    ``reasoning_parser``: ``--reasoning-parser`` (``reasoning.PARSERS``; None: chat answers are all content).
    ``enable_auto_tool_choice``, ``tool_call_parser``: tool_choice "auto" answered, its calls
    parsed in that format (None: the chat template's, ``tool_parsers.auto_tool_parser``).
    Keyword arguments only.
    """

    model: str | None = None
    served_model_name: str | None = None
    host: str = _HTTP.host
    port: int = _HTTP.port
    max_model_len: int | None = None
    endpoints: Endpoints
    max_body_bytes: int | None = None
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    max_queue_len: int | None = None
    api_key: str | None = field(default=None, repr=False)
    heartbeat_timeout: float = _LIVENESS.heartbeat_timeout
    playground: bool = _HTTP.playground
    zmq_curve: str | None = None
    restarts_file: str | None = None
    chat_template: str | None = field(default=None, repr=False)
    generation_config: str = _HTTP.generation_config
    tokenizer: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = _HTTP.enable_auto_tool_choice
    tool_call_parser: str | None = None
    pooling_type: str = _HTTP.pooling_type  # --pooling-type: the embeddings' pooling (last or mean)

    def __post_init__(self) -> None:
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty")
        if not self.host:
            raise ValueError("--host must not be empty")
        if not _is_int(self.port) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be an integer in [0, 65535] (0 picks a free port), got {self.port!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"--max-model-len must be an integer of at least 2, got {self.max_model_len!r}")
        if self.max_body_bytes is not None and (not _is_int(self.max_body_bytes) or self.max_body_bytes < 1024):
            raise ValueError(f"max_body_bytes must be an integer of at least 1024, got {self.max_body_bytes!r}")
        if self.max_queue_len is not None and (not _is_int(self.max_queue_len) or self.max_queue_len < 1):
            raise ValueError(f"--max-queue-len must be a positive integer, got {self.max_queue_len!r}")
        if self.api_key is not None and (not self.api_key or self.api_key != self.api_key.strip()):
            raise ValueError("--api-key must not be empty or start or end with spaces")
        if isinstance(self.heartbeat_timeout, bool) or not isinstance(self.heartbeat_timeout, (int, float)) \
                or not self.heartbeat_timeout > 0:
            raise ValueError(f"--heartbeat-timeout must be a positive number of seconds, "
                             f"got {self.heartbeat_timeout!r}")
        check_setting(self.generation_config)
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if not self.endpoints.request:
            raise ValueError("--request-endpoint is required (or set PAGEDSERVE_REQUEST_ENDPOINT)")
        for value in self.request_endpoints:
            if not value.startswith(_ENDPOINT_SCHEMES):
                raise ValueError(f"--request-endpoint must start with one of {', '.join(_ENDPOINT_SCHEMES)}, "
                                 f"got {value!r}")
        if len(set(self.request_endpoints)) != len(self.request_endpoints):
            raise ValueError(f"--request-endpoint names a scheduler twice: {self.endpoints.request!r}")

    @property
    def request_endpoints(self) -> list[str]:
        """One scheduler's endpoint, or several separated by commas: data-parallel replicas, each
        request going to one of them (``replicas``)."""
        return [part.strip() for part in self.endpoints.request.split(",")]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
