"""The msgpack codec: the tag table of every top-level message, ``encode``/``decode``, and
``DecodeError`` for a frame that is not one of them (the package docstring states the format).

Field hints are resolved in each message class's own module, so that module imports whatever its
annotations name (nested messages such as ``SamplingParams`` included)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import msgpack
import numpy as np

from shared.messages.control import EngineStats, ExecutorReady, Heartbeat, Hello, ProcessLost, Shutdown
from shared.messages.kv import KvSnapshot, KvWatch
from shared.messages.requests import AbortRequest, AddRequest, FrontendHello, RequestOutput, RequestOutputs
from shared.messages.steps import Step, StepResult


class DecodeError(ValueError):
    """A frame that is not a well-formed message of a known type."""


# Every top-level message by its ``TAG``: the only classes ``decode`` builds (with the dataclasses
# nested in their fields).
MESSAGE_TYPES: dict[int, type] = {
    cls.TAG: cls
    for cls in (
        AddRequest, AbortRequest, RequestOutput, RequestOutputs, FrontendHello, Step, StepResult, ExecutorReady, Hello,
        Heartbeat, Shutdown, ProcessLost, EngineStats, KvWatch, KvSnapshot,
    )
}


def _encode_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        return [arr.dtype.newbyteorder("<").str, list(arr.shape), arr.astype(arr.dtype.newbyteorder("<")).tobytes()]
    if dataclasses.is_dataclass(value):
        return [_encode_value(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list):
        return [_encode_value(v) for v in value]
    return value


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)  # in the class's module, which imports what it names
        _HINTS[cls] = hints
    return hints


_HINTS: dict[type, dict[str, Any]] = {}


def _decode_value(hint: Any, raw: Any) -> Any:
    if hint is np.ndarray:
        if not (isinstance(raw, list) and len(raw) == 3):
            raise DecodeError(f"expected [dtype, shape, bytes] for an array, got {type(raw).__name__}")
        dtype, shape, data = raw
        try:
            dt = np.dtype(dtype)
            if dt.kind not in "biuf":
                raise DecodeError(f"array dtype {dtype!r} is not allowed")
            return np.frombuffer(data, dtype=dt).reshape(shape).astype(dt.newbyteorder("="))
        except (TypeError, ValueError) as exc:
            raise DecodeError(f"bad array: {exc}") from exc
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _decode_dataclass(hint, raw)
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(raw, list):
            raise DecodeError(f"expected a list, got {type(raw).__name__}")
        return [_decode_value(item, v) for v in raw]
    return raw


def _decode_dataclass(cls: type, raw: Any) -> Any:
    fields = dataclasses.fields(cls)
    if not isinstance(raw, list) or len(raw) != len(fields):
        raise DecodeError(f"{cls.__name__}: expected {len(fields)} fields")
    hints = _hints(cls)
    return cls(**{f.name: _decode_value(hints[f.name], v) for f, v in zip(fields, raw)})


def encode(msg: Any) -> bytes:
    """Serialize a registered message dataclass to bytes."""
    tag = getattr(type(msg), "TAG", None)
    if MESSAGE_TYPES.get(tag) is not type(msg):
        raise TypeError(f"{type(msg).__name__} is not a registered message type")
    return msgpack.packb([tag, _encode_value(msg)], use_bin_type=True)


def decode(frame: bytes) -> Any:
    """Parse bytes into a registered message; raises ``DecodeError`` on anything else."""
    try:
        tag, fields = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise DecodeError(f"not a message frame: {exc}") from exc
    cls = MESSAGE_TYPES.get(tag) if isinstance(tag, int) else None
    if cls is None:
        raise DecodeError(f"unknown message tag {tag!r}")
    try:
        return _decode_dataclass(cls, fields)
    except TypeError as exc:
        raise DecodeError(f"{cls.__name__}: {exc}") from exc
