"""The launcher's private socket directory: its ipc:// paths always fit a Unix socket's path."""

import os
import shutil
import stat
import tempfile

import zmq

from shared.endpoints import LONGEST_SOCKET_NAME, Endpoints, make_private_socket_dir


def _bind_all(directory: str) -> None:
    ctx = zmq.Context()
    try:
        for endpoint in [*vars(Endpoints.in_directory(directory)).values(),
                         f"ipc://{os.path.join(directory, LONGEST_SOCKET_NAME)}"]:
            sock = ctx.socket(zmq.PULL)
            sock.bind(endpoint)  # raises ZMQError when the path is too long
            sock.close(linger=0)
    finally:
        ctx.term()


def test_a_deep_tmpdir_falls_back_to_tmp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    directory = make_private_socket_dir()
    try:
        assert not directory.startswith(str(deep)) and directory.startswith("/tmp/pagedserve-")
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert os.listdir(deep) == []  # the too-deep attempt was removed
        _bind_all(directory)
    finally:
        shutil.rmtree(directory)


def test_a_short_tmpdir_is_used(tmp_path, monkeypatch):
    short = tmp_path / "t"
    short.mkdir()
    monkeypatch.setenv("TMPDIR", str(short))
    monkeypatch.setattr("tempfile.tempdir", None)
    directory = make_private_socket_dir()
    assert os.path.dirname(directory) == str(short)
    _bind_all(directory)


def test_replica_sockets_fit_too(monkeypatch):
    """A TMPDIR where one engine's sockets fit and the twelfth replica's would not: -dp 12's
    directory goes to /tmp, -dp 1's stays."""
    from services.data_parallel import longest_socket_name, replica_prefix

    longest = longest_socket_name(12)
    assert longest == "r11-request.sock" and len(longest) == len(LONGEST_SOCKET_NAME) + 1
    assert longest_socket_name(1) == "" and replica_prefix(3) == "r3-"
    limit = getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 107
    parent = tempfile.mkdtemp(dir="/tmp")
    base = os.path.join(parent, "b" * (limit - len(LONGEST_SOCKET_NAME) - len(parent) - len("//pagedserve-12345678/")))
    os.makedirs(base)
    monkeypatch.setenv("TMPDIR", base)
    monkeypatch.setattr("tempfile.tempdir", None)
    try:
        one = make_private_socket_dir()
        many = make_private_socket_dir(longest)
        assert len(os.path.join(one, LONGEST_SOCKET_NAME)) == limit and os.path.dirname(one) == base
        assert os.path.dirname(many) == "/tmp" and len(os.path.join(many, longest)) <= limit
        for directory in (one, many):
            shutil.rmtree(directory)
    finally:
        shutil.rmtree(parent)
