"""The smoke's checks on what the services logged (``docker logs``, JSON lines): every line is JSON,
each restarted executor answered the scheduler's Hello with its epoch, the GGUF model was
converted at most once, and with ``compose.curve.yaml`` every ZeroMQ socket uses CURVE."""

from __future__ import annotations

import json

from deploy.compose import ComposeProject

SERVICES = ("scheduler", "executor", "frontend")


def check_json_logs(report, project: ComposeProject) -> None:
    counts, examples = {}, []
    for service in SERVICES:
        lines = project.log_lines(service)
        not_json = [line for line in lines if not _is_json_object(line)]
        counts[service] = f"{len(lines) - len(not_json)}/{len(lines)}"
        examples += not_json[:1]
    report.check("the logs are JSON lines", not examples,
                 f"JSON lines per service: {counts}" + (f"; not JSON: {examples}" if examples else ""))


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def log_events(project: ComposeProject, service: str, event: str) -> list[dict]:
    """The service's JSON log lines (every start of its container) whose ``event`` is ``event``."""
    lines = [json.loads(line) for line in project.log_lines(service) if _is_json_object(line)]
    return [line for line in lines if line.get("event") == event]


def count_events(project: ComposeProject, service: str, event: str) -> int:
    return len(log_events(project, service, event))


def check_restart_logs(report, project: ComposeProject) -> None:
    """Three executor processes (the first, after docker kill, after the crash): the scheduler saw
    each one lost and each new one answer its Hello with the current epoch (``executor ready`` is
    logged only then); the model was converted from GGUF at most once (the gguf-cache volume)."""
    counts = {event: count_events(project, service, event) for service, event in (
        ("executor", "model loaded"), ("scheduler", "executor lost; waiting for a new one"),
        ("scheduler", "executor ready"))}
    report.check("the scheduler handed every new executor its epoch", counts["model loaded"] >= 3
                 and counts["executor lost; waiting for a new one"] >= 2 and counts["executor ready"] >= 3,
                 f"events: {counts}")
    converted = {service: count_events(project, service, "converting gguf once") for service in SERVICES}
    report.check("the GGUF model converted at most once (gguf-cache volume)", sum(converted.values()) <= 1,
                 f"'converting gguf once' per service: {converted}, executor starts: {counts['model loaded']}")


def check_curve_logs(report, project: ComposeProject) -> None:
    modes = {service: sorted({line.get("mode") for line in log_events(project, service, "zmq security")})
             for service in SERVICES}
    report.check("every service's ZeroMQ sockets use CURVE", all(m == ["curve"] for m in modes.values()),
                 f"zmq security modes logged: {modes}")
