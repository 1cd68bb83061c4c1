"""``--zmq-curve`` (``shared/zmq_auth.py``): key files, their loading and its errors, and the
scheduler's sockets refusing every client without an allowed key (in-process, real ZeroMQ)."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import structlog
import zmq
from zmq.utils.monitor import recv_monitor_message

from services.frontend.main import add_frontend_arguments, frontend_config_from_args
from services.group_layout import GroupLayout
from services.launcher import zmq_curve_dir
from services.scheduler.executors import ExecutorLink
from services.scheduler.frontends import FrontendLink
from services.scheduler.liveness import ExecutorGroup
from shared import zmq_auth
from shared.messages import AddRequest, FrontendHello, Heartbeat, SamplingParams, decode, encode
from shared.zmq_auth import CurveKeys, create_keys, load_keys, secure_client, start_authenticator

HANDSHAKE_TIMEOUT_MS = 60_000  # guards against a hang only


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def key_dir(tmp_path):
    create_keys(str(tmp_path / "keys"))
    return str(tmp_path / "keys")


def test_keys_are_zeromq_certificates_with_private_modes(key_dir):
    for role in zmq_auth.ROLES:
        public, secret = zmq.auth.load_certificate(f"{key_dir}/private/{role}.key_secret")
        assert secret is not None and len(secret) == 40
        assert zmq.auth.load_certificate(f"{key_dir}/public/{role}.key") == (public, None)
        assert _mode(f"{key_dir}/private/{role}.key_secret") == 0o600
        assert _mode(f"{key_dir}/public/{role}.key") == 0o644
    assert _mode(f"{key_dir}/private") == 0o700
    assert sorted(os.listdir(f"{key_dir}/private")) == sorted(f"{r}.key_secret" for r in zmq_auth.ROLES)


def test_each_role_loads_its_own_keys_and_the_scheduler_its_allow_lists(key_dir):
    server = load_keys(key_dir, "scheduler")
    frontend, executor = load_keys(key_dir, "frontend"), load_keys(key_dir, "executor")
    assert len({server.public_key, frontend.public_key, executor.public_key}) == 3
    assert frontend.server_key == executor.server_key == server.public_key
    assert server.client_keys == {"frontend": {frontend.public_key}, "executor": {executor.public_key}}
    assert frontend.client_keys == {} and executor.client_keys == {}
    assert frontend.secret_key not in repr(frontend).encode()


def test_existing_keys_are_kept_unless_forced(key_dir):
    before = load_keys(key_dir, "scheduler").public_key
    with pytest.raises(ValueError, match=r"scheduler\.key_secret exists.*--force"):
        create_keys(key_dir)
    assert load_keys(key_dir, "scheduler").public_key == before
    create_keys(key_dir, force=True)
    assert load_keys(key_dir, "scheduler").public_key != before


def test_a_missing_directory_or_file_is_named_with_the_flag(tmp_path, key_dir):
    with pytest.raises(ValueError, match=rf"--zmq-curve {tmp_path}/nowhere: no such directory"):
        load_keys(str(tmp_path / "nowhere"), "frontend")
    os.remove(f"{key_dir}/private/frontend.key_secret")
    with pytest.raises(ValueError, match=rf"--zmq-curve: {key_dir}/private/frontend\.key_secret .*is missing"):
        load_keys(key_dir, "frontend")
    os.remove(f"{key_dir}/public/scheduler.key")
    with pytest.raises(ValueError, match=rf"{key_dir}/public/scheduler\.key \(the scheduler's public key\) is missing"):
        load_keys(key_dir, "executor")


def test_a_secret_key_others_can_read_is_refused(key_dir):
    path = f"{key_dir}/private/executor.key_secret"
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match=rf"--zmq-curve: {path} is readable by other users \(mode 0640\); chmod 600"):
        load_keys(key_dir, "executor")


def test_the_scheduler_needs_a_key_per_client_role_and_takes_extra_ones(key_dir):
    extra_public, _ = zmq.auth.create_certificates(f"{key_dir}/public", "frontend-b")
    extra_key = zmq.auth.load_certificate(extra_public)[0]
    os.remove(f"{key_dir}/public/frontend-b.key_secret")
    assert extra_key in load_keys(key_dir, "scheduler").client_keys["frontend"]
    os.remove(f"{key_dir}/public/executor.key")
    with pytest.raises(ValueError, match=r"no executor public key in .*/public \(executor\.key\)"):
        load_keys(key_dir, "scheduler")


def test_the_flag_or_the_environment_names_the_directory(monkeypatch):
    parser = argparse.ArgumentParser()
    add_frontend_arguments(parser)
    endpoint = ["--request-endpoint", "ipc:///nowhere/request.sock"]
    monkeypatch.delenv(zmq_auth.ENV_VAR, raising=False)
    assert frontend_config_from_args(parser.parse_args(endpoint)).zmq_curve is None
    monkeypatch.setenv(zmq_auth.ENV_VAR, "/from/env")
    assert frontend_config_from_args(parser.parse_args(endpoint)).zmq_curve == "/from/env"
    assert frontend_config_from_args(parser.parse_args([*endpoint, "--zmq-curve", "/flag"])).zmq_curve == "/flag"


def test_serve_makes_throwaway_keys_on_one_host_only(tmp_path, monkeypatch):
    monkeypatch.delenv(zmq_auth.ENV_VAR, raising=False)
    args = argparse.Namespace(zmq_curve=zmq_auth.EPHEMERAL)
    directory = zmq_curve_dir(args, GroupLayout(), str(tmp_path))
    assert directory == str(tmp_path / "zmq-curve")
    assert load_keys(directory, "scheduler").client_keys["frontend"] == {load_keys(directory, "frontend").public_key}
    with pytest.raises(ValueError, match="--zmq-curve needs a key directory with --nnodes 2"):
        zmq_curve_dir(args, GroupLayout(world_size=2, num_nodes=2), str(tmp_path / "other"))
    assert zmq_curve_dir(argparse.Namespace(zmq_curve=None), GroupLayout(), str(tmp_path)) is None


def test_a_process_with_a_missing_key_exits_2_naming_the_path(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "scheduler", "--zmq-curve", str(tmp_path),
         *(f"--{n}-endpoint=ipc://{tmp_path}/{n}.sock" for n in ("request", "step", "result"))],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PAGEDSERVE_LOG_FORMAT": "json"},
    )
    assert proc.returncode == 2, proc.stderr
    assert f"--zmq-curve: {tmp_path}/private/scheduler.key_secret (this process's secret key) is missing" in proc.stderr


# ---------------------------------------------------------------- the scheduler's sockets


def _connect(ctx: zmq.Context, kind: int, endpoint: str, keys: CurveKeys | None, identity: bytes = b""):
    """A client socket and its monitor (to see how its handshake ended)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    secure_client(sock, keys)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    sock.connect(endpoint)
    return sock, monitor


def _send_if_queued(sock, frame: bytes) -> None:
    """Send ``frame`` from a client whose handshake is meant to fail, without blocking. Whether it
    can be queued is a race: ZeroMQ drops the connection's pipe when the handshake fails, and a
    DEALER or PUSH socket with no pipe would block in ``send`` for good (seen on a loaded machine:
    the test's thread came to its ``send`` after the refusal). Queued or not, it must never reach
    the scheduler, which the tests check on its side."""
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass


def _handshake(monitor) -> zmq.Event:
    assert monitor.poll(HANDSHAKE_TIMEOUT_MS), "no handshake event"
    return zmq.Event(recv_monitor_message(monitor)["event"])


def _stranger(server: CurveKeys, role: str) -> CurveKeys:
    """Well-formed CURVE keys the scheduler has never heard of (and that know its public key)."""
    public, secret = zmq.curve_keypair()
    return CurveKeys(role, "", public, secret, server.public_key)


def _add_request(request_id: str) -> bytes:
    params = SamplingParams(max_tokens=4, eos_token_ids=[0])
    return encode(AddRequest(request_id, np.array([1, 2, 3], np.int32), params, 0.0))


@pytest.fixture
def scheduler_side(key_dir, tmp_path):
    """The scheduler's frontend and executor links, CURVE servers behind the ZAP allow-list."""
    keys = load_keys(key_dir, "scheduler")
    ctx = zmq.Context()
    log = structlog.get_logger()
    auth = start_authenticator(ctx, keys, log)
    endpoints = {n: f"ipc://{tmp_path}/{n}.sock" for n in ("request", "step", "result")}
    frontends = FrontendLink(ctx, endpoints["request"], log, curve=keys)
    executors = ExecutorLink(ctx, endpoints["step"], endpoints["result"], ExecutorGroup(1, 10.0, 300.0), 1, log,
                             curve=keys)
    yield ctx, keys, endpoints, frontends, executors
    auth.stop()
    ctx.destroy(linger=0)


def test_only_the_frontend_key_reaches_the_request_socket(scheduler_side, key_dir):
    ctx, server, endpoints, frontends, _ = scheduler_side
    refused = {"stranger": (_stranger(server, "frontend"), zmq.Event.HANDSHAKE_FAILED_AUTH),
               "executor": (load_keys(key_dir, "executor"), zmq.Event.HANDSHAKE_FAILED_AUTH)}
    for name, (keys, expected) in refused.items():
        sock, monitor = _connect(ctx, zmq.DEALER, endpoints["request"], keys, f"rogue-{name}".encode())
        _send_if_queued(sock, _add_request(f"rogue-{name}"))  # a handshake must pass before it can leave
        assert _handshake(monitor) == expected, name
    plain, monitor = _connect(ctx, zmq.DEALER, endpoints["request"], None, b"rogue-plain")
    _send_if_queued(plain, _add_request("rogue-plain"))
    assert _handshake(monitor) != zmq.Event.HANDSHAKE_SUCCEEDED
    good, monitor = _connect(ctx, zmq.DEALER, endpoints["request"], load_keys(key_dir, "frontend"), b"frontend-ok")
    good.send(encode(FrontendHello(os.getpid())))
    good.send(_add_request("good"))
    assert _handshake(monitor) == zmq.Event.HANDSHAKE_SUCCEEDED
    received = [frontends.recv(HANDSHAKE_TIMEOUT_MS) for _ in range(2)]
    assert isinstance(received[0], FrontendHello) and received[1].request_id == "good"
    assert list(frontends.frontends) == [b"frontend-ok"]
    assert not frontends.socket.poll(0)  # nothing else came in: the strangers' requests never arrived


def test_only_the_executor_key_reaches_the_step_and_result_sockets(scheduler_side, key_dir):
    ctx, server, endpoints, _, executors = scheduler_side
    for keys in (_stranger(server, "executor"), load_keys(key_dir, "frontend")):
        sub, sub_monitor = _connect(ctx, zmq.SUB, endpoints["step"], keys)
        push, push_monitor = _connect(ctx, zmq.PUSH, endpoints["result"], keys)
        _send_if_queued(push, encode(Heartbeat(0, 99, 1)))
        assert _handshake(sub_monitor) == _handshake(push_monitor) == zmq.Event.HANDSHAKE_FAILED_AUTH
    executor = load_keys(key_dir, "executor")
    push, monitor = _connect(ctx, zmq.PUSH, endpoints["result"], executor)
    push.send(encode(Heartbeat(0, 7, 1)))
    assert _handshake(monitor) == zmq.Event.HANDSHAKE_SUCCEEDED
    assert executors.results.poll(HANDSHAKE_TIMEOUT_MS)
    assert decode(executors.results.recv()).incarnation == 7
    assert not executors.results.poll(0)
