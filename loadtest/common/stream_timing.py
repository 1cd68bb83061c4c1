"""Token timings of one streamed chat completion, read from its server-sent events.

``read_stream`` takes the response's lines as they arrive and notes when each chunk that carries
text arrives. From those times: time to first token (TTFT), the gaps between consecutive text
chunks (inter-token latency, ITL: one gap per chunk, as vLLM's serving benchmark counts it; a chunk
usually holds one token) and the end-to-end latency (E2E, to ``data: [DONE]``). No I/O here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class StreamTimes:
    start_s: float
    token_times_s: list[float] = field(default_factory=list)  # arrival of each chunk with text
    end_s: float | None = None  # when [DONE] arrived (None: the stream ended without it)
    num_output_tokens: int | None = None  # from the final usage chunk, when the server sent one
    error: str | None = None  # an error event's message

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.start_s if self.token_times_s else None

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times_s, self.token_times_s[1:])]

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s

    def problem(self, num_tokens_expected: int | None = None) -> str | None:
        """Why this stream counts as a failure, or ``None``."""
        if self.error:
            return f"error event: {self.error}"
        if self.end_s is None:
            return "the stream ended without data: [DONE]"
        if not self.token_times_s:
            return "no token was streamed"
        if (num_tokens_expected is not None and self.num_output_tokens is not None
                and self.num_output_tokens != num_tokens_expected):
            return f"{self.num_output_tokens} output tokens, expected {num_tokens_expected} (ignore_eos)"
        return None


def read_stream(lines: Iterable[bytes | str], start_s: float,
                clock: Callable[[], float] = time.perf_counter) -> StreamTimes:
    """Consume an SSE body line by line; ``start_s`` is ``clock()`` when the request was sent."""
    times = StreamTimes(start_s)
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            times.end_s = clock()
            break
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            times.error = str(error.get("message", error) if isinstance(error, dict) else error)
            break
        if any((choice.get("delta") or {}).get("content") for choice in chunk.get("choices") or ()):
            times.token_times_s.append(clock())
        if chunk.get("usage"):
            times.num_output_tokens = chunk["usage"].get("completion_tokens")
    return times
