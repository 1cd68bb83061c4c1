"""``--kv-events-config``: where the scheduler publishes its KV cache events, spelled as vLLM's JSON.

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}

The fields, their defaults and the rule for ``publisher`` are vLLM's ``KVEventsConfig``
(``vllm/config/kv_events.py``): ``publisher`` left out is "zmq" when events are enabled, else "null".
``parse`` validates the text and raises ``ValueError`` with one line saying what is wrong; the
flag's argparse type calls it, so a bad value stops the command at start. What is published and
how: ``services/scheduler/kv_events_zmq.py``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from shared.flag_spec import json_object

PUBLISHERS = ("null", "zmq")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KvEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null" (vLLM's rule)
    endpoint: str = "tcp://*:5557"  # the PUB socket: bound when it has * or :: or is ipc/inproc, else connected
    replay_endpoint: str | None = None  # a ROUTER for replays of buffered batches (None: no replay)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # vLLM's publisher queue; ours sends inline, so only validated
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        _check_types(self)
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv events config: publisher must be one of {', '.join(PUBLISHERS)}, "
                             f"got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv events config: {name} must be a positive integer, got {getattr(self, name)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(_SCHEMES):
                raise ValueError(f"kv events config: {name} must start with tcp://, ipc:// or inproc://, got {value!r}")

    @property
    def publishes(self) -> bool:
        """Whether events are computed and sent (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


_TYPES = {"enable_kv_cache_events": (bool,), "publisher": (str,), "endpoint": (str,),
          "replay_endpoint": (str, type(None)), "buffer_steps": (int,), "hwm": (int,), "max_queue_size": (int,),
          "topic": (str,)}


def _check_types(config: KvEventsConfig) -> None:
    for name, types in _TYPES.items():
        value = getattr(config, name)
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            raise ValueError(f"kv events config: {name} has the wrong type ({type(value).__name__}: {value!r})")


def parse(text: str | None) -> KvEventsConfig | None:
    """The config that ``text`` (JSON, or None/"" for none) spells; ``ValueError`` if it is not one."""
    if not text:
        return None
    values = json_object(text, "--kv-events-config")
    unknown = set(values) - {f.name for f in fields(KvEventsConfig)}
    if unknown:
        raise ValueError(f"kv events config: unknown keys {sorted(unknown)} (known: {sorted(_TYPES)})")
    return KvEventsConfig(**values)


def flag_type(text: str) -> str:
    """argparse's type for the flag: the text itself, once ``parse`` accepts it."""
    try:
        parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """Replica ``data_parallel_rank``'s endpoint, as vLLM offsets it: tcp's port plus the rank,
    inproc (and, ours, ipc) with ``_dp<rank>`` appended; rank 0 keeps the endpoint."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"kv events config: endpoint {endpoint!r} has no port to offset for replica "
                             f"{data_parallel_rank}")
        return f"{base}:{int(port) + data_parallel_rank}"
    return f"{endpoint}_dp{data_parallel_rank}"


def check_replicas(text: str | None, count: int) -> None:
    """``ValueError`` when ``count`` replicas' offset ports would collide (replica i takes the
    endpoint's and the replay endpoint's ports + i: they must be ``count`` apart)."""
    config = parse(text)
    if config is None or not config.publishes or count == 1 or not config.replay_endpoint:
        return
    ports = [int(e.rpartition(":")[2]) for e in (config.endpoint, config.replay_endpoint)
             if e.startswith("tcp://") and e.rpartition(":")[2].isdigit()]
    if len(ports) == 2 and abs(ports[0] - ports[1]) < count:
        raise ValueError(f"--kv-events-config: with -dp {count} replica i publishes on port {ports[0]} + i and "
                         f"replays on {ports[1]} + i; put the two ports at least {count} apart")
