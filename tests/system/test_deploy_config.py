"""What compose.yaml and compose.gpu.yaml promise, read without a Docker engine; and the frontend's
API key file (the compose secret). ``tests/system/test_docker.py`` checks the same on a real engine."""

from __future__ import annotations

import argparse
import os
import re

import pytest
import yaml

from services.frontend.main import add_frontend_arguments, api_key_from_env, frontend_config_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVICES = ("scheduler", "executor", "frontend")


def _load(name: str) -> dict:
    with open(os.path.join(ROOT, name)) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load("compose.yaml")


def test_every_service_has_a_healthcheck_a_restart_policy_and_rotated_json_logs(compose):
    for name in SERVICES:
        service = compose["services"][name]
        assert service["healthcheck"]["test"][:4] == ["CMD", "pagedserve", "health", name], name
        assert service["restart"] in ("unless-stopped", "on-failure", "always"), name
        assert service["logging"]["driver"] == "json-file" and service["logging"]["options"]["max-size"], name
        assert service["image"].startswith("${PAGEDSERVE_IMAGE:-"), name
        assert service["tmpfs"] == ["/tmp/pagedserve-health:uid=10001,gid=10001,mode=0700"], name  # fresh per start


def test_the_numba_cache_outlives_the_containers(compose):
    """NUMBA_CACHE_DIR (the image's) is a named volume: an executor made anew (compose down / up,
    a new image) loads its kernels instead of compiling them again (several seconds each)."""
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        dockerfile = f.read()
    [cache_dir] = re.findall(r"NUMBA_CACHE_DIR=(\S+)", dockerfile)
    assert cache_dir in dockerfile.split("install -d", 1)[1].split("\nCOPY", 1)[0]  # made, owned by the user
    mounts = dict(v.split(":", 1)[::-1] for v in compose["services"]["executor"]["volumes"])
    assert mounts[cache_dir] in compose["volumes"]


def test_only_the_frontend_is_published_and_on_loopback_by_default(compose):
    services = compose["services"]
    assert "ports" not in services["scheduler"] and "ports" not in services["executor"]
    # A host port range, so that `--scale frontend=2` gives each frontend a port of its own
    assert services["frontend"]["ports"] == ["${PAGEDSERVE_BIND:-127.0.0.1}:${PAGEDSERVE_PORT_RANGE:-8000-8001}:8000"]


def test_start_order_waits_for_health(compose):
    services = compose["services"]
    assert services["executor"]["depends_on"] == {"scheduler": {"condition": "service_healthy"}}
    assert {name: dep["condition"] for name, dep in services["frontend"]["depends_on"].items()} == {
        "scheduler": "service_healthy", "executor": "service_healthy"}


def test_the_api_key_comes_from_a_secret_file_never_argv(compose):
    frontend = compose["services"]["frontend"]
    assert frontend["secrets"] == ["pagedserve_api_key"]
    assert frontend["environment"]["PAGEDSERVE_API_KEY_FILE"] == "/run/secrets/pagedserve_api_key"
    assert not any("key" in str(arg).lower() for arg in frontend["command"])
    default = compose["secrets"]["pagedserve_api_key"]["file"].split(":-")[1].rstrip("}")
    assert os.path.getsize(os.path.join(ROOT, default)) == 0  # no key unless one is configured


def test_the_gpu_override_reserves_nvidia_gpus_for_the_executor():
    gpu = _load("compose.gpu.yaml")["services"]
    devices = gpu["executor"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "${PAGEDSERVE_GPU_COUNT:-all}", "capabilities": ["gpu"]}]
    assert all(gpu[name]["build"]["args"]["TORCH_VARIANT"] == "cuda" for name in SERVICES)
    # the executor puts the model on the GPU it is given: --device auto unless PAGEDSERVE_DEVICE says
    command = _load("compose.yaml")["services"]["executor"]["command"]
    assert command[command.index("--device") + 1] == "${PAGEDSERVE_DEVICE:-auto}"
    from services.cli import build_parser

    parsed = build_parser().parse_args([arg.split(":-")[1].rstrip("}") if "${" in arg else arg for arg in command])
    assert (parsed.device, parsed.dtype) == ("auto", "auto")


def _frontend_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_frontend_arguments(parser)
    return parser.parse_args(["--request-endpoint", "ipc:///tmp/r.sock", *argv])


def test_api_key_file(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    monkeypatch.setenv("PAGEDSERVE_API_KEY_FILE", str(key_file))
    assert api_key_from_env() == "s3cret"
    assert frontend_config_from_args(_frontend_args()).api_key == "s3cret"
    assert frontend_config_from_args(_frontend_args("--api-key", "flag")).api_key == "flag"  # the flag wins
    key_file.write_text("")
    assert frontend_config_from_args(_frontend_args()).api_key is None
    monkeypatch.setenv("PAGEDSERVE_API_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="PAGEDSERVE_API_KEY_FILE: cannot read .*missing"):
        api_key_from_env()


def test_the_curve_override_gives_each_service_its_own_secret_key_only():
    from shared.zmq_auth import ENV_VAR, ROLES

    curve = _load("compose.curve.yaml")["services"]
    assert sorted(curve) == sorted(SERVICES) == sorted(ROLES)
    for name in SERVICES:
        service = curve[name]
        key_dir = service["environment"][ENV_VAR]
        mounts = {target: source for source, target, mode in (v.rsplit(":", 2) for v in service["volumes"])}
        assert all(v.endswith(":ro") for v in service["volumes"]), name
        secrets = [t for t in mounts if "/private/" in t]
        assert secrets == [f"{key_dir}/private/{name}.key_secret"], name  # the layout zmq_auth.load_keys reads
        assert mounts[f"{key_dir}/public"] == "${PAGEDSERVE_ZMQ_KEYS:-./zmq-keys}/public", name
        assert mounts[secrets[0]] == f"${{PAGEDSERVE_ZMQ_KEYS:-./zmq-keys}}/private/{name}.key_secret", name
        assert "ports" not in service, name  # CURVE protects the ports; publishing them stays a choice
