"""``pagedserve simulate --html PATH``: a self-contained page that replays a simulated run step by
step, the contiguous policy beside the paged one, for teaching.

The same request stream runs through the scheduler and block manager under both policies
(``scheduler.simulate``); after every step a ``KvSnapshot`` is taken (``scheduler.kv_snapshot``, as
for ``/v1/kv/events``) and kept in its JSON form (``shared.kv_json``). The page is the playground's
own map code and style (``frontend/static``: kvdraw, kvmap and kvtable, read as files) with a
small player, all inlined with the frames, so it opens from disk with no server and nothing
fetched.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from services.scheduler.kv_snapshot import build_kv_snapshot
from services.scheduler.scheduler import Scheduler
from services.scheduler.simulate import parse_requests, simulate
from shared.kv_json import kv_snapshot_json

POLICIES = ("contiguous", "paged")


def record_run(requests: list[tuple[int, int]], num_slots: int, block_size: int, max_model_len: int,
               kv_policy: str) -> dict[str, Any]:
    """One policy's run: a frame per step (the first before any step) and the run's summary."""
    frames: list[dict[str, Any]] = []
    request_ids = [f"r{i}" for i in range(len(requests))]

    def observe(sched: Scheduler) -> None:
        sched.blocks.events.set_enabled(True)
        snapshot = kv_snapshot_json(build_kv_snapshot(sched, len(frames)))
        finished = [rid for rid in request_ids if rid not in sched.groups]
        frames.append({"snapshot": snapshot, "finished": finished})

    summary = simulate(requests, num_slots, block_size, max_model_len, kv_policy, observe=observe)
    return {"frames": frames, "summary": summary}


def replay_data(requests: list[tuple[int, int]], num_slots: int, block_size: int, max_model_len: int) -> dict:
    """Everything the page shows: the stream, the pool, both runs."""
    return {
        "requests": [{"request_id": f"r{i}", "prompt": p, "answer": a} for i, (p, a) in enumerate(requests)],
        "num_slots": num_slots,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "runs": {policy: record_run(requests, num_slots, block_size, max_model_len, policy) for policy in POLICIES},
    }


def _asset(name: str) -> str:
    return resources.files("services.frontend").joinpath("static", name).read_text(encoding="utf-8")


def _script_safe(text: str) -> str:
    """Text that cannot end the ``<script>`` element it is inlined into."""
    return text.replace("</", "<\\/")


def render_page(data: dict) -> str:
    """The page's HTML with its style, scripts and frames inlined."""
    page = _asset("replay.html")
    frames_json = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    scripts = {f"/*{name.upper()}*/": _script_safe(_asset(f"{name}.js"))
               for name in ("kvdraw", "kvmap", "kvtable", "replay")}
    for marker, text in (("/*STYLE*/", _asset("style.css")), *scripts.items(), ("/*DATA*/", frames_json)):
        assert page.count(marker) == 1, marker
        page = page.replace(marker, text)
    return page


def write_replay_page(args) -> Path:
    """Write ``args.html`` from ``simulate``'s flags; returns its path."""
    requests = parse_requests(args.requests)
    path = Path(args.html)
    path.write_text(render_page(replay_data(requests, args.num_slots, args.block_size, args.max_model_len)),
                    encoding="utf-8")
    return path
