"""Every message that crosses a socket, with its msgpack encoding.

Wire format: one msgpack array ``[tag, fields]`` where ``tag`` is the small integer registered for
the message class and ``fields`` a list in dataclass field order. Integer and float arrays travel as
``[dtype, shape, raw little-endian bytes]``. Nested message dataclasses (``SamplingParams``,
``NewSequence``) are encoded as field lists too. Nothing is ever pickled: decoding only builds the
dataclasses registered here, and anything else raises ``DecodeError``.

The messages live in one module per concept, and are imported from here (``from shared.messages
import Step``): ``requests`` (frontend <-> scheduler), ``steps`` (scheduler <-> executors),
``control`` (joining, liveness, shutdown, stats), ``kv`` (block-pool snapshots); ``codec`` holds
the tag table (``MESSAGE_TYPES``), ``encode`` and ``decode``. A new message gets a unique ``TAG``,
a place in ``MESSAGE_TYPES`` and a round-trip case in ``tests/shared/test_messages.py``.
"""

from shared.messages.codec import MESSAGE_TYPES, DecodeError, decode, encode
from shared.messages.control import (
    EngineStats, ExecutorHealth, ExecutorReady, Heartbeat, Hello, ProcessLost, Shutdown,
)
from shared.messages.kv import KvEventKind, KvSnapshot, KvWatch
from shared.messages.requests import (
    AbortRequest, AddRequest, FrontendHello, RequestOutput, RequestOutputs, SamplingParams,
)
from shared.messages.steps import PLACEHOLDER_TOKEN_ID, NewSequence, Step, StepResult

__all__ = [
    "MESSAGE_TYPES", "PLACEHOLDER_TOKEN_ID", "AbortRequest", "AddRequest", "DecodeError", "EngineStats",
    "ExecutorHealth", "ExecutorReady", "FrontendHello", "Heartbeat", "Hello", "KvEventKind", "KvSnapshot",
    "KvWatch", "NewSequence", "ProcessLost", "RequestOutput", "RequestOutputs", "SamplingParams", "Shutdown", "Step", "StepResult",
    "decode", "encode",
]
