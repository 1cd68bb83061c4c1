"""A frame from the scheduler that does not decode (``engine_client``): what can still be read of it
goes on, and each request whose output cannot be read fails rather than waits forever."""

from __future__ import annotations

import msgpack
import structlog

from shared.messages import DecodeError, RequestOutput, RequestOutputs, decode

log = structlog.get_logger()


def salvaged_outputs(frame: bytes, exc: DecodeError) -> list[RequestOutput]:
    """The outputs to route for undecodable ``frame``: each that decodes alone, and an error output
    (``request_finished``) for each request whose output is broken but whose id can be read."""
    readable = readable_outputs(frame)
    failed = [o for o in readable if isinstance(o, str)]
    log.error("dropped an undecodable frame from the scheduler", error=str(exc), size=len(frame),
              request_ids=failed)
    return [RequestOutput(output, 0, [], "error", request_finished=True, error_kind="engine",
                          error=f"engine output was malformed: {exc}") if isinstance(output, str) else output
            for output in readable]


def readable_outputs(frame: bytes) -> list[RequestOutput | str]:
    """What can still be read of a malformed ``RequestOutputs`` frame, in order: each output that
    decodes on its own, else its request id where that can be read."""
    try:
        tag, fields = msgpack.unpackb(frame, raw=False)
        if tag != RequestOutputs.TAG:
            return []
        items = list(fields[0])
    except Exception:  # anything at all may be wrong with this frame
        return []
    readable: list[RequestOutput | str] = []
    for item in items:
        try:
            readable.append(decode(msgpack.packb([RequestOutput.TAG, item], use_bin_type=True)))
        except Exception:  # noqa: BLE001 - this output is broken: its request id, if readable
            if isinstance(item, list) and item and isinstance(item[0], str):
                readable.append(item[0])
    return readable
