"""``GET /v1/kv/events``: the scheduler's block-pool snapshots as server-sent events.

``KvHub`` fans the ``KvSnapshot`` messages of the scheduler out to this frontend's clients. The
scheduler sends them only while some frontend watches, so the hub watches (``KvWatch(on=True)``,
renewed every ``renew_s``) exactly while it has at least one client, and says ``off`` when the last
one leaves: with no client connected, nothing is built, sent or encoded.

Each snapshot is encoded once (``shared.kv_json``, one ``data:`` line) and offered to every
client's mailbox, which holds only the newest frame: a client that reads slowly gets fewer
updates (each one it misses is counted in ``num_dropped``), never a growing queue, and nothing
here ever waits on a client. A client's handler takes the next frame only once what it wrote
before has left (the connection's send buffer is kept small, ``SEND_BUFFER_BYTES``), so a slow
client sees the newest state rather than a backlog of old ones; one whose stream stays stalled for
the write deadline (``--http-write-timeout``) is cut. Comments (``: keep-alive``) go out when the
pool is quiet for ``KEEPALIVE_S``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Iterator

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.frontend.engine_client import EngineClient
from services.frontend.replicas import Replicas
from services.frontend.http_limits import HTTP_LIMITS
from services.frontend.responses import sse_event
from shared.kv_json import kv_snapshot_json
from shared.messages import KvSnapshot

log = structlog.get_logger()

RENEW_S = 1.0
KEEPALIVE_S = 15.0
SEND_BUFFER_BYTES = 32 * 1024  # the kernel's send buffer of an events connection (loopback's default is MBs)
MAX_BACKLOG_BYTES = 32 * 1024  # written but not yet handed to the kernel: past it, wait before taking a frame
BACKLOG_POLL_S = 0.05


class Mailbox:
    """One client's newest undelivered frame; an older one still there is replaced (and counted)."""

    def __init__(self) -> None:
        self._frame: bytes | None = None
        self._ready = asyncio.Event()
        self.closed = False
        self.num_dropped = 0

    def offer(self, frame: bytes) -> bool:
        """Leave ``frame`` for the client; False if it replaced one the client had not taken."""
        replaced = self._frame is not None
        self._frame = frame
        self._ready.set()
        self.num_dropped += replaced
        return not replaced

    async def take(self, timeout_s: float) -> bytes | None:
        """The newest frame, waiting at most ``timeout_s``; None on timeout or once closed."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            return None
        self._ready.clear()
        frame, self._frame = self._frame, None
        return None if self.closed else frame

    def close(self) -> None:
        self.closed = True
        self._ready.set()


class KvHub:
    """The clients of ``/v1/kv/events`` on this frontend, and its watch at the scheduler."""

    def __init__(self, client: EngineClient | Replicas, renew_s: float = RENEW_S) -> None:
        self.client = client
        self.renew_s = renew_s
        self.mailboxes: set[Mailbox] = set()
        self._renewer: asyncio.Task | None = None
        self.latest_frame: bytes | None = None  # while watching: what a new client gets first
        self.num_snapshots = 0  # received from the scheduler
        self.num_dropped = 0  # frames replaced before their client took them, all clients
        client.on_kv_snapshot = self.on_snapshot

    def subscribe(self) -> Mailbox:
        mailbox = Mailbox()
        self.mailboxes.add(mailbox)
        if len(self.mailboxes) == 1:
            self.client.watch_kv(True)
            self._renewer = asyncio.create_task(self._renew(), name="kv-watch-renewal")
            log.info("kv events: watching the block pool")
        elif self.latest_frame is not None:
            mailbox.offer(self.latest_frame)
        return mailbox

    def unsubscribe(self, mailbox: Mailbox) -> None:
        self.mailboxes.discard(mailbox)
        if self.mailboxes or self._renewer is None:
            return
        self._renewer.cancel()
        self._renewer = None
        self.latest_frame = None
        self.client.watch_kv(False)
        log.info("kv events: no client left; stopped watching")

    def on_snapshot(self, snapshot: KvSnapshot) -> None:
        """Encode once, leave it in every mailbox. Never waits."""
        if not self.mailboxes:
            return  # sent before the scheduler heard our "off"
        self.num_snapshots += 1
        frame = self.latest_frame = sse_event(kv_snapshot_json(snapshot))
        for mailbox in self.mailboxes:
            self.num_dropped += not mailbox.offer(frame)

    async def close(self, _app: web.Application | None = None) -> None:
        """End every client's stream (shutdown)."""
        for mailbox in list(self.mailboxes):
            mailbox.close()

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.renew_s)
            self.client.watch_kv(True)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(_HubCollector(self))


class _HubCollector(Collector):
    def __init__(self, hub: KvHub) -> None:
        self._hub = hub

    def collect(self) -> Iterator[Metric]:
        hub = self._hub
        stats = hub.client.latest_stats
        yield GaugeMetricFamily("pagedserve:kv_events_clients", "Clients streaming /v1/kv/events.",
                                value=len(hub.mailboxes))
        yield CounterMetricFamily("pagedserve:kv_events_dropped", "Block-pool snapshots a slow /v1/kv/events "
                                  "client missed (replaced by a newer one before it read them).", value=hub.num_dropped)
        yield CounterMetricFamily("pagedserve:kv_snapshots", "Block-pool snapshots the scheduler built (only while "
                                  "some /v1/kv/events client watches).", value=stats.num_kv_snapshots if stats else 0)


async def kv_events(request: web.Request, hub: KvHub) -> web.StreamResponse:
    """Stream snapshots until the client leaves (its handler is cancelled), stalls past the write
    deadline, or the server stops."""
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await response.prepare(request)
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    stall_limit_s = request.app[HTTP_LIMITS].write_timeout_s
    mailbox = hub.subscribe()
    try:
        await response.write(b": block-pool snapshots follow\n\n")
        while not mailbox.closed and await _drained(transport, mailbox, stall_limit_s):
            frame = await mailbox.take(KEEPALIVE_S)
            if frame is not None:
                await response.write(frame)
            elif not mailbox.closed:
                await response.write(b": keep-alive\n\n")
    finally:
        hub.unsubscribe(mailbox)
    return response


async def _drained(transport: asyncio.Transport | None, mailbox: Mailbox, stall_limit_s: float) -> bool:
    """Wait until the client has taken what was written (its mailbox meanwhile keeps only the
    newest frame); False, with the connection cut, when it has not for ``stall_limit_s``."""
    if transport is None:
        return True
    stalled_since = time.monotonic()
    while transport.get_write_buffer_size() > MAX_BACKLOG_BYTES and not mailbox.closed:
        if transport.is_closing():
            return False
        if time.monotonic() - stalled_since > stall_limit_s:
            log.info("kv events: client stalled; cut", stalled_s=round(stall_limit_s, 1))
            transport.abort()
            return False
        await asyncio.sleep(BACKLOG_POLL_S)
    return True
