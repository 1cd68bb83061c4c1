"""The deployment smoke test: build the image offline, start compose, ask, kill the executor, stop.

``deploy/smoke.sh`` runs it for people and prints each step, the times and the image size;
``tests/system/test_docker.py`` runs the same ``run_smoke`` and asserts on its report. Steps:

1. ``deploy/build-image.sh`` (offline: ``docker build --network=none``), unless ``--no-build``;
2. ``compose up -d`` as project ``pagedserve-smoke`` on free ports of 127.0.0.1, then wait until
   the scheduler, the executor and the frontend are healthy;
3. a streamed chat answer through the official ``openai`` client (the default SmolLM2, temperature
   0, "What is the capital of France?"), which must contain "Paris";
4. ``docker kill`` the executor and watch what Docker and compose do; then ``compose up -d``;
5. crash the executor's process inside its container and watch the restart policy bring it back;
   after each recovery the same question again; the logs show each new executor process answering
   the scheduler (``executor ready``) and the GGUF model converted at most once (the ``gguf-cache``
   volume keeps the converted copy across restarts);
6. ``--scale frontend=N`` (``--frontends``, default 2): concurrent greedy requests spread over the
   N frontends' ports all come back with the one-frontend text (``deploy/scaling.py``);
7. recreate the frontend with an API key file as its compose secret: without the key a 401;
8. ``compose down``, and check that no container or network of the project is left.

Along the way: only the frontend's port is published (on 127.0.0.1), the services run as a
non-root user, and their logs are JSON lines. ``--curve DIR`` deploys with ``compose.curve.yaml``
(CURVE on every ZeroMQ socket; keys made in DIR by ``pagedserve keys`` when it has none) and checks
that every service logs ``zmq security`` with ``mode=curve``.

The executor runs in float32 (``PAGEDSERVE_DTYPE``; ``--dtype``): the checks compare greedy texts
exactly, across restarts and batch compositions, and only float32 makes that hold (in bfloat16 a
prompt answered alone and the same prompt in a batch of 20 can round to different greedy tokens).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deploy.compose import ComposeProject, compose_command, run  # noqa: E402
from deploy.log_checks import SERVICES, check_curve_logs, check_json_logs, check_restart_logs  # noqa: E402
from deploy.scaling import check_scaled_frontends, greedy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTION = "What is the capital of France?"
HEALTHY_TIMEOUT_S = 600.0
OBSERVE_AFTER_KILL_S = 20.0


@dataclass
class SmokeReport:
    image: str
    image_size: str = "?"
    times_s: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what was observed, in order
    checks: dict[str, tuple[bool, str]] = field(default_factory=dict)  # name -> (passed, detail)

    def check(self, name: str, passed: bool, detail: str) -> bool:
        self.checks[name] = (passed, detail)
        say(f"{'PASS' if passed else 'FAIL'} {name}: {detail}")
        return passed

    def note(self, text: str) -> None:
        self.notes.append(text)
        say(text)

    @property
    def passed(self) -> bool:
        return all(ok for ok, _ in self.checks.values())


def say(text: str) -> None:
    print(f"smoke: {text}", flush=True)


def why_not_runnable(image: str) -> str | None:
    """``None`` when a Docker engine, compose and the image (or what builds it) are here, else why not."""
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    info = run(["docker", "info", "--format", "{{.ServerVersion}}"], 20, check=False)
    if info.returncode != 0:
        return f"no Docker daemon reachable (docker info: {info.stderr.strip()[-200:]})"
    if compose_command() is None:
        return "neither `docker compose` nor `docker-compose` is installed"
    base = os.environ.get("BASE_IMAGE", "pagedserve-base:bookworm")
    can_debootstrap = shutil.which("debootstrap") is not None and os.geteuid() == 0
    if not (_have_image(image) or _have_image(base) or can_debootstrap):
        return f"no image {image}, no base image {base}, and no debootstrap as root to make one"
    return None


def _have_image(ref: str) -> bool:
    return run(["docker", "image", "inspect", ref], 20, check=False).returncode == 0


def build(report: SmokeReport) -> None:
    start = time.monotonic()
    env = {**os.environ, "PAGEDSERVE_IMAGE": report.image}
    say(f"building {report.image} offline (deploy/build-image.sh; its output goes to stderr)")
    # Its output on our stderr (fd 2): people watch it, and pytest captures it.
    proc = subprocess.run([os.path.join(ROOT, "deploy", "build-image.sh")], env=env, cwd=ROOT, stdout=2,
                          timeout=3600)
    report.times_s["build"] = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"deploy/build-image.sh exited with {proc.returncode} (its output is above)")
    report.note(f"built {report.image} offline in {report.times_s['build']:.1f} s")


def ask_and_check(report: SmokeReport, project: ComposeProject, name: str, reference: str | None = None) -> str:
    """The streamed greedy answer to QUESTION contains "Paris" and, after a restart, is exactly
    ``reference`` (the first answer): a restart loses no token and repeats none."""
    start = time.monotonic()
    try:
        answer = greedy(frontend_port(project), QUESTION, max_tokens=40)
    except Exception as exc:  # noqa: BLE001 (what the client saw is the result)
        answer = f"<{type(exc).__name__}: {exc}>"
    report.times_s[name] = time.monotonic() - start
    same = reference is None or answer == reference
    report.check(name, "Paris" in answer and same, f"{answer!r} in {report.times_s[name]:.1f} s"
                 + ("" if reference is None else f"; identical to the first answer: {same}"))
    return answer


def watch_after_docker_kill(report: SmokeReport, project: ComposeProject) -> None:
    before = project.state("executor")["restart_count"]
    run(["docker", "kill", project.container_id("executor", include_stopped=False)], 60)
    time.sleep(OBSERVE_AFTER_KILL_S)
    st = project.state("executor")
    restarted = st["restart_count"] > before or st["status"] == "running"
    report.note(f"docker kill executor: {OBSERVE_AFTER_KILL_S:.0f} s later it is {st['status']} (exit code "
                f"{st['exit_code']}, restarts {st['restart_count']}): "
                + ("the restart policy restarted it" if restarted else
                   "not restarted (Docker cancels the restart policy of a container stopped by docker kill)"))
    start = time.monotonic()
    project.compose("up", "-d")
    project.wait_healthy(SERVICES, HEALTHY_TIMEOUT_S)
    report.times_s["recovery after docker kill (compose up -d)"] = time.monotonic() - start
    report.note(f"compose up -d: executor healthy again after {time.monotonic() - start:.1f} s "
                f"(restarts {project.state('executor')['restart_count']})")


def watch_after_crash(report: SmokeReport, project: ComposeProject) -> None:
    before = project.state("executor")["restart_count"]
    project.crash_main_process("executor")
    start = time.monotonic()
    deadline = start + HEALTHY_TIMEOUT_S
    while project.state("executor")["restart_count"] == before and time.monotonic() < deadline:
        time.sleep(0.5)
    st = project.state("executor")
    report.check("restart policy restarts a crashed executor", st["restart_count"] > before,
                 f"restarts {before} -> {st['restart_count']} after {time.monotonic() - start:.1f} s")
    report.note(f"right after the restart Docker reports the executor {st['health']} (its last status)")
    project.wait_alive("executor", HEALTHY_TIMEOUT_S)
    report.times_s["recovery after crash (restart policy)"] = time.monotonic() - start
    report.note(f"the restarted executor's heartbeat passes {time.monotonic() - start:.1f} s after the crash")


def check_exposure(report: SmokeReport, project: ComposeProject) -> None:
    published = {service: project.published_ports(service) for service in SERVICES}
    only_frontend = (not published["scheduler"] and not published["executor"] and published["frontend"] != []
                     and all(p.startswith("127.0.0.1:") for p in published["frontend"]))
    report.check("only the frontend is published, on 127.0.0.1", only_frontend, f"published: {published}")
    uids = {service: project.exec(service, "id", "-u").strip() for service in SERVICES}
    report.check("the services run as a non-root user", "0" not in uids.values(), f"uids: {uids}")


def frontend_port(project: ComposeProject) -> int:
    """The host port of the (first) frontend: Docker picks it from ``PAGEDSERVE_PORT_RANGE``."""
    ports = project.host_ports("frontend")
    if not ports:
        raise RuntimeError(f"the frontend publishes no port: {project.published_ports('frontend')}")
    return ports[0]


def curve_keys(key_dir: str) -> str:
    """``key_dir`` made absolute, with CURVE keys made there first if it has none (readable by the
    image's user, uid 10001, when we are root)."""
    key_dir = os.path.abspath(key_dir)
    if not os.path.exists(os.path.join(key_dir, "public", "scheduler.key")):
        run([sys.executable, "-m", "services.cli", "keys", "--out", key_dir], 120)
        say(f"made CURVE keys in {key_dir} (pagedserve keys)")
    if os.geteuid() == 0:
        for parent, _, names in os.walk(key_dir):
            for path in [parent, *(os.path.join(parent, n) for n in names)]:
                os.chown(path, 10001, 10001)
    return key_dir


def check_api_key_secret(report: SmokeReport, project: ComposeProject) -> None:
    """Recreate the frontend with a key file as its compose secret: /v1/models needs the key."""
    key = secrets.token_hex(16)
    with tempfile.NamedTemporaryFile("w", prefix="pagedserve-smoke-", suffix=".key", delete=False) as f:
        f.write(key + "\n")
    try:
        if os.geteuid() == 0:
            os.chown(f.name, 10001, 10001)  # the image's user must read the mounted secret
        else:
            os.chmod(f.name, 0o644)
        project.env["PAGEDSERVE_API_KEY_FILE"] = f.name
        project.compose("up", "-d", "--no-deps", "--force-recreate", "frontend")
        project.wait_healthy(SERVICES, HEALTHY_TIMEOUT_S)
        url = f"http://127.0.0.1:{frontend_port(project)}/v1/models"
        without, with_key = _http_status(url, None), _http_status(url, key)
        argv = project.exec("frontend", "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    except (RuntimeError, TimeoutError) as exc:
        report.check("API key from a compose secret", False, f"{type(exc).__name__}: {exc}")
        return
    finally:
        project.env.pop("PAGEDSERVE_API_KEY_FILE", None)
        os.unlink(f.name)
    report.check("API key from a compose secret", without == 401 and with_key == 200 and key not in argv,
                 f"/v1/models answered {without} without the key and {with_key} with it; key on a command line: "
                 f"{key in argv}")


def _http_status(url: str, key: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def run_smoke(image: str = "pagedserve:cpu", do_build: bool = True, port: int | None = None,
              num_frontends: int = 2, num_requests: int = 20, curve_dir: str | None = None,
              dtype: str = "float32") -> SmokeReport:
    report = SmokeReport(image)
    if do_build:
        try:
            build(report)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            report.check("image builds offline", False, str(exc))
            return report
    report.image_size = run(["docker", "image", "ls", image, "--format", "{{.Size}}"], 30).stdout.strip()
    report.note(f"image {image}: {report.image_size}")
    port = port or _free_ports(num_frontends)
    ports = f"{port}-{port + num_frontends - 1}" if num_frontends > 1 else str(port)
    env = {"PAGEDSERVE_IMAGE": image, "PAGEDSERVE_PORT_RANGE": ports, "PAGEDSERVE_DTYPE": dtype}
    if curve_dir is not None:
        env["PAGEDSERVE_ZMQ_KEYS"] = curve_keys(curve_dir)
    project = ComposeProject(ROOT, "pagedserve-smoke", env, ("compose.curve.yaml",) if curve_dir else ())
    report.note(f"{' '.join(project.base)} up -d (project pagedserve-smoke, frontend ports 127.0.0.1:{ports}, executor --dtype {dtype})")
    try:
        start = time.monotonic()
        project.compose("up", "-d")  # compose itself waits for each dependency to be healthy
        project.wait_healthy(SERVICES, HEALTHY_TIMEOUT_S)
        report.times_s["up to healthy"] = time.monotonic() - start
        report.note(f"all three healthy {report.times_s['up to healthy']:.1f} s after compose up -d began")
        check_exposure(report, project)
        first = ask_and_check(report, project, "first answer")
        check_json_logs(report, project)
        if curve_dir is not None:
            check_curve_logs(report, project)
        watch_after_docker_kill(report, project)
        ask_and_check(report, project, "answer after docker kill + compose up -d", first)
        watch_after_crash(report, project)
        ask_and_check(report, project, "answer after executor crash + restart", first)
        check_restart_logs(report, project)
        if num_frontends > 1:
            check_scaled_frontends(report, project, SERVICES, num_frontends, num_requests, HEALTHY_TIMEOUT_S)
        check_api_key_secret(report, project)
    except Exception as exc:
        report.check("deployment steps", False, f"{type(exc).__name__}: {exc}")
        say("last logs:\n" + project.logs_tail())
    finally:
        project.compose("down", "--remove-orphans", check=False)
        left = project.leftovers()
        report.check("compose down leaves nothing", not left, f"left: {left}" if left else "no container, no network")
    return report


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 (the frontends' host port range)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + count <= 65536 and all(_port_free(p) for p in range(first + 1, first + count)):
            return first
    raise RuntimeError(f"found no {count} consecutive free ports on 127.0.0.1")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def print_summary(report: SmokeReport) -> None:
    print("\n== pagedserve compose smoke ==")
    print(f"{'image size':45s} {report.image_size}")
    for name, seconds in report.times_s.items():
        print(f"{name:45s} {seconds:7.1f} s")
    for name, (ok, detail) in report.checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deploy/smoke.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--image", default=os.environ.get("PAGEDSERVE_IMAGE", "pagedserve:cpu"))
    parser.add_argument("--no-build", action="store_true", help="use the image as it is")
    parser.add_argument("--port", type=int, default=None,
                        help="first host port of the frontends' range (default: the first of free ones)")
    parser.add_argument("--frontends", type=int, default=2,
                        help="scale the frontend to this many replicas for the concurrent-requests step (1: skip it)")
    parser.add_argument("--requests", type=int, default=20, help="concurrent requests over the scaled frontends")
    parser.add_argument("--curve", metavar="DIR", default=None,
                        help="add compose.curve.yaml with the CURVE keys in DIR (made there when missing)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "auto", "bfloat16", "float16"],
                        help="the executor's --dtype (PAGEDSERVE_DTYPE; default float32: greedy texts compare exactly)")
    args = parser.parse_args(argv)
    if args.frontends < 1 or args.requests < 1:
        parser.error(f"--frontends ({args.frontends}) and --requests ({args.requests}) must be at least 1")
    why = why_not_runnable(args.image)
    if why:
        print(f"smoke: cannot run: {why}", file=sys.stderr)
        return 2
    report = run_smoke(args.image, do_build=not args.no_build, port=args.port, num_frontends=args.frontends,
                       num_requests=args.requests, curve_dir=args.curve, dtype=args.dtype)
    print_summary(report)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
