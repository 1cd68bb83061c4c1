"""``pagedserve health scheduler|executor|frontend``: exit 0 when that process is alive, else 1.

For container healthchecks. The scheduler and the executors have no HTTP port: they touch a
heartbeat file in ``$PAGEDSERVE_HEALTH_DIR`` from their loops (``shared/heartbeat_file.py``; the image
sets the variable) and the check compares its age with ``--max-age-s``. An executor touches it
before and after every step, so only a single step longer than ``--max-age-s`` (default 30 s)
reads as a failure; the scheduler touches it on every turn of its loop, which never blocks on a
step (it notices a lost executor by itself, and waits for a new one: the executor's own file tells
whether that one is alive). The frontend is asked ``GET /health``, which answers 200 only once the
scheduler reports ready and every executor rank answers its heartbeats.
Imports nothing heavy: a healthcheck runs this every few seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from services.frontend.flags import HttpFlags
from shared.heartbeat_file import health_dir, heartbeat_age_s, heartbeat_path

DEFAULT_MAX_AGE_S = 30.0
SERVICES = ("scheduler", "executor", "frontend")


def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("service", choices=SERVICES)
    parser.add_argument("--max-age-s", type=float, default=DEFAULT_MAX_AGE_S,
                        help="scheduler, executor: the oldest heartbeat that still counts (default: %(default)s)")
    parser.add_argument("--rank", type=int, default=0, help="executor: which rank (default: %(default)s)")
    parser.add_argument("--host", default=HttpFlags().host, help="frontend: where it listens (default: %(default)s)")
    parser.add_argument("--port", type=int, default=HttpFlags().port, help="frontend: its HTTP port (default: %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=5.0,
                        help="frontend: how long to wait for /health (default: %(default)s)")


def heartbeat_name(service: str, rank: int = 0) -> str:
    """The heartbeat file name each process uses: ``scheduler``, ``executor-<rank>``."""
    return "scheduler" if service == "scheduler" else f"{service}-{rank}"


def check_heartbeat(name: str, max_age_s: float) -> tuple[bool, str]:
    directory = health_dir()
    if directory is None:
        return False, f"{name}: PAGEDSERVE_HEALTH_DIR is not set, so no process writes a heartbeat"
    age_s = heartbeat_age_s(name, directory)
    if age_s is None:
        return False, f"{name}: no heartbeat yet at {heartbeat_path(name, directory)}"
    if age_s > max_age_s:
        return False, f"{name}: last heartbeat {age_s:.1f} s ago, older than --max-age-s {max_age_s:g}"
    return True, f"{name}: alive (heartbeat {age_s:.1f} s ago)"


def check_frontend(host: str, port: int, timeout_s: float) -> tuple[bool, str]:
    url = f"http://{host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return True, f"frontend: {url} answered {resp.status}"
    except urllib.error.HTTPError as exc:
        reason = _reason(exc.read())
        return False, f"frontend: {url} answered {exc.code}" + (f" ({reason})" if reason else "")
    except OSError as exc:
        return False, f"frontend: {url} unreachable: {exc}"


def _reason(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    return str(data.get("reason") or data.get("status") or "") if isinstance(data, dict) else ""


def run_health(args: argparse.Namespace) -> int:
    if args.service == "frontend":
        ok, message = check_frontend(args.host, args.port, args.timeout_s)
    else:
        ok, message = check_heartbeat(heartbeat_name(args.service, args.rank), args.max_age_s)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve health", description=__doc__.split("\n")[0])
    add_health_arguments(parser)
    return run_health(parser.parse_args(argv))
