"""The playground: a chat page at ``/`` with a live map of the KV block pool, its static files
under ``/static/``, and the block-pool events it draws from (``/v1/kv/events``, ``kv_stream``).

The page and its files are plain HTML, CSS and JavaScript shipped inside the package (no build
step, nothing fetched from elsewhere), read once when the application is created. They hold no
data, so they need no API key (a browser cannot send one when it opens a page); the page asks for
the key and sends it as ``Bearer`` on every API call, events included. ``--no-playground`` leaves
all three routes out (404).
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from services.frontend.engine_client import EngineClient
from services.frontend.errors import APIError
from services.frontend.kv_stream import KvHub, kv_events
from services.frontend.state import STATE

KV_HUB = web.AppKey("kv_hub", KvHub)
_JS = "text/javascript; charset=utf-8"
STATIC_TYPES = {  # the page's files, in the order index.html loads them
    "index.html": "text/html; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "page.js": _JS,  # helpers the page's scripts share
    "kvdraw.js": _JS,  # painting a pool on a canvas
    "kvmap.js": _JS,  # the map of a pool (also inlined by simulate --html)
    "kvtable.js": _JS,  # block-table chips, cell descriptions
    "pool.js": _JS,  # the pool panel: counters, sequences, tooltip, pause
    "chat.js": _JS,  # the chat
    "app.js": _JS,  # the wiring: key, model, the events stream
}
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
}


def is_page_path(path: str) -> bool:
    """The page and its files: open without an API key (they hold no data)."""
    return path == "/" or path.startswith("/static/")


def static_file(name: str) -> bytes:
    """One of the page's files, as shipped in the package (``simulate --html`` inlines them too)."""
    return resources.files("services.frontend").joinpath("static", name).read_bytes()


def add_playground(app: web.Application, client: EngineClient) -> KvHub:
    """Add ``/``, ``/static/{name}`` and ``/v1/kv/events`` to ``app`` (after its ``STATE`` is set:
    the hub's metrics join its registry); returns the events hub."""
    files = {name: static_file(name) for name in STATIC_TYPES}
    hub = app[KV_HUB] = KvHub(client)
    hub.register_metrics(app[STATE].metrics.registry)

    def serve(name: str) -> web.Response:
        if name not in files:
            raise APIError(404, f"Invalid URL (GET /static/{name})", code="not_found")
        return web.Response(body=files[name], headers={"Content-Type": STATIC_TYPES[name], **PAGE_HEADERS})

    async def index(request: web.Request) -> web.Response:
        return serve("index.html")

    async def static(request: web.Request) -> web.Response:
        return serve(request.match_info["name"])

    async def events(request: web.Request) -> web.StreamResponse:
        return await kv_events(request, hub)

    app.router.add_get("/", index)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/v1/kv/events", events)
    app.on_shutdown.insert(0, hub.close)
    return hub
