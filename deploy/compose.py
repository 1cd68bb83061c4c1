"""A compose project driven from Python: up, health, kill, down (for ``deploy/smoke.py`` and its test).

Works with Compose v2 (``docker compose``) and v1 (``docker-compose``), whichever is installed.
Containers are found by compose's labels, so v1's ``project_service_1`` and v2's
``project-service-1`` names both work.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time


def run(argv: list[str], timeout_s: float = 120.0, env: dict[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


def compose_command() -> list[str] | None:
    """``["docker", "compose"]`` (v2) or ``["docker-compose"]`` (v1), or ``None``."""
    if shutil.which("docker") and run(["docker", "compose", "version"], 30, check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


class ComposeProject:
    """One compose project of this repository's ``compose.yaml`` (plus ``extra_files``)."""

    def __init__(self, root: str, name: str, env: dict[str, str], extra_files: tuple[str, ...] = ()) -> None:
        self.root = root
        self.name = name
        self.env = {**os.environ, **env}
        self.base = compose_command() or ["docker-compose"]
        files = ("compose.yaml", *extra_files)
        self.argv = [*self.base, "-p", name, "--project-directory", root,
                     *[arg for f in files for arg in ("-f", os.path.join(root, f))]]

    def compose(self, *args: str, timeout_s: float = 600.0, check: bool = True) -> subprocess.CompletedProcess:
        return run([*self.argv, *args], timeout_s, env=self.env, check=check)

    def container_ids(self, service: str, include_stopped: bool = True) -> list[str]:
        """The service's containers (several when it is scaled), oldest first."""
        argv = ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.name}",
                "--filter", f"label=com.docker.compose.service={service}"]
        return run(argv + (["-a"] if include_stopped else []), 30).stdout.split()[::-1]

    def container_id(self, service: str, include_stopped: bool = True) -> str | None:
        ids = self.container_ids(service, include_stopped)
        return ids[0] if ids else None

    def leftovers(self) -> list[str]:
        """Every container (running or not) and network of the project, as ``kind:id``."""
        label = f"label=com.docker.compose.project={self.name}"
        containers = run(["docker", "ps", "-aq", "--filter", label], 30).stdout.split()
        networks = run(["docker", "network", "ls", "-q", "--filter", label], 30).stdout.split()
        return [f"container:{c}" for c in containers] + [f"network:{n}" for n in networks]

    def inspect_all(self, service: str) -> list[dict]:
        """``docker inspect`` of each of the service's containers, oldest first."""
        ids = self.container_ids(service)
        return json.loads(run(["docker", "inspect", *ids], 30).stdout) if ids else []

    def inspect(self, service: str) -> dict | None:
        """``docker inspect`` of the service's (first) container, or ``None`` when it has none."""
        infos = self.inspect_all(service)
        return infos[0] if infos else None

    def state(self, service: str) -> dict:
        """``{"status", "exit_code", "restart_count", "health"}`` of the service's (first) container."""
        return _state(self.inspect(service))

    def states(self, service: str) -> list[dict]:
        """``state`` of each of the service's containers (one absent state when it has none)."""
        return [_state(info) for info in self.inspect_all(service)] or [_state(None)]

    def published_ports(self, service: str) -> list[str]:
        """The ports of the service's containers published on the host, as ``host_ip:host_port->port``."""
        return [f"{b['HostIp']}:{b['HostPort']}->{port}" for info in self.inspect_all(service)
                for port, bindings in ((info.get("NetworkSettings") or {}).get("Ports") or {}).items()
                for b in bindings or ()]

    def host_ports(self, service: str, port: str = "8000/tcp") -> list[int]:
        """The host port that each of the service's containers publishes ``port`` on, oldest first."""
        return [int(b["HostPort"]) for info in self.inspect_all(service)
                for b in ((info.get("NetworkSettings") or {}).get("Ports") or {}).get(port) or ()]

    def exec(self, service: str, *argv: str) -> str:
        return run(["docker", "exec", self.container_id(service, include_stopped=False), *argv], 60).stdout

    def log_lines(self, service: str) -> list[str]:
        """Everything the service's container wrote, stdout and stderr, line by line."""
        proc = run(["docker", "logs", self.container_id(service)], 60)
        return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]

    def wait_healthy(self, services: tuple[str, ...], timeout_s: float) -> float:
        """Seconds until every container of every service is running and healthy; raises after ``timeout_s``."""
        start = time.monotonic()
        while True:
            states = {s: self.states(s) for s in services}  # every replica of a scaled service
            if all(st["status"] == "running" and st["health"] == "healthy" for sts in states.values() for st in sts):
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"not all of {services} healthy within {timeout_s:.0f} s: {states}")
            time.sleep(1.0)

    def wait_alive(self, service: str, timeout_s: float) -> float:
        """Seconds until ``pagedserve health <service>`` passes inside the running container. Unlike
        the health status, this is not stale after a restart: Docker keeps a restarted container's
        last status until ``retries`` probes have failed."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            cid = self.container_id(service, include_stopped=False)
            if cid and run(["docker", "exec", cid, "pagedserve", "health", service], 60, check=False).returncode == 0:
                return time.monotonic() - start
            time.sleep(1.0)
        raise TimeoutError(f"pagedserve health {service} did not pass within {timeout_s:.0f} s")

    def crash_main_process(self, service: str) -> None:
        """SIGKILL the service's process inside its container (the child of compose's ``init``), as a
        crash would: unlike ``docker kill``, Docker then applies the restart policy."""
        self.exec(service, "sh", "-c", "kill -KILL $(cat /proc/1/task/1/children)")

    def logs_tail(self, num_lines: int = 20) -> str:
        return self.compose("logs", "--no-color", "--tail", str(num_lines), check=False, timeout_s=60).stdout


def _state(info: dict | None) -> dict:
    if info is None:
        return {"status": "absent", "exit_code": None, "restart_count": 0, "health": None}
    state = info["State"]
    return {"status": state["Status"], "exit_code": state["ExitCode"], "restart_count": info["RestartCount"],
            "health": (state.get("Health") or {}).get("Status")}
