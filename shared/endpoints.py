"""ZeroMQ endpoint names shared by the three services.

By default every socket is an ``ipc://`` file in one private (0700) temporary directory that the
launcher creates and removes. Each endpoint can be overridden by a flag or an environment variable
(``PAGEDSERVE_REQUEST_ENDPOINT`` and so on), which is how compose wires ``tcp://`` endpoints.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoints:
    # frontends' DEALERs <-> scheduler ROUTER: AddRequest, AbortRequest, FrontendHello in; each
    # request's RequestOutputs back to the frontend that sent it, EngineStats to every frontend
    request: str
    step: str  # scheduler PUB -> executors SUB (Step, Hello, Shutdown)
    result: str  # executors PUSH -> scheduler PULL (StepResult, ExecutorReady, Heartbeat)

    @classmethod
    def in_directory(cls, directory: str, prefix: str = "") -> "Endpoints":
        """``ipc://`` files in ``directory``, their names after ``prefix`` (a data-parallel replica's)."""
        return cls(**{name: f"ipc://{os.path.join(directory, prefix + name)}.sock" for name in cls.names()})

    @classmethod
    def from_env(cls, fallback: "Endpoints | None" = None) -> "Endpoints | None":
        values = {n: os.environ.get(f"PAGEDSERVE_{n.upper()}_ENDPOINT") for n in cls.names()}
        if fallback is not None:
            values = {n: v or getattr(fallback, n) for n, v in values.items()}
        if not all(values.values()):
            return None
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        return {f"PAGEDSERVE_{n.upper()}_ENDPOINT": getattr(self, n) for n in self.names()}

    @staticmethod
    def names() -> tuple[str, ...]:
        return ("request", "step", "result")


# the longest socket file name the launcher puts in its directory (with one replica)
LONGEST_SOCKET_NAME = "supervisor.sock"


def make_private_socket_dir(longest_name: str = LONGEST_SOCKET_NAME) -> str:
    """A fresh 0700 directory for ipc:// socket files (mkdtemp creates it with mode 0700): in the
    temporary directory ($TMPDIR), or in /tmp when a deep $TMPDIR would make the socket paths
    longer than a Unix socket's path may be; ``longest_name``: the longest file name to fit, if
    longer than ``LONGEST_SOCKET_NAME`` (data-parallel replicas' sockets)."""
    import zmq  # here: `pagedserve health` imports this module and must stay light

    ipc_path_max = getattr(zmq, "IPC_PATH_MAX_LEN", 0) or 107  # sockaddr_un.sun_path less its NUL
    path = tempfile.mkdtemp(prefix="pagedserve-")
    longest = max(LONGEST_SOCKET_NAME, longest_name, key=len)
    if len(os.path.join(path, longest)) <= ipc_path_max:
        return path
    os.rmdir(path)
    return tempfile.mkdtemp(prefix="pagedserve-", dir="/tmp")
