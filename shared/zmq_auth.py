"""ZeroMQ CURVE security (``--zmq-curve``) for the sockets between frontend, scheduler and executors.

Without the flag every socket is plain ZeroMQ (ipc:// in a 0700 directory, or tcp:// on a
private network such as compose's). With it, every connection is encrypted and authenticated
with CurveZMQ, both ways:

- The scheduler binds every endpoint and is the CURVE server of all of them. A ZAP handler (pyzmq's
  ``ThreadAuthenticator`` on the scheduler's context, started before any socket binds) accepts a
  client only if its public key is on the allow-list of that socket's ZAP domain: ``frontend``
  for the request socket, ``executor`` for the step and result sockets. A client with any other
  key, or a plain (NULL-mechanism) client, never completes the handshake, so not one of its
  messages reaches the scheduler (and no step reaches it).
- The frontends and executors are CURVE clients: each proves its own secret key and checks the
  scheduler's public key, so they cannot be talked to by an impostor either.

Keys live in files, never on a command line, in ZeroMQ's certificate format
(``zmq.auth.create_certificates``; ``pagedserve keys --out DIR`` writes them)::

    DIR/public/scheduler.key         every process needs it (clients check the server with it)
    DIR/public/frontend.key          the scheduler's allow-list for the request socket
    DIR/public/executor.key          the scheduler's allow-list for the step and result sockets
    DIR/private/<role>.key_secret    each process needs only its own (mode 0600, directory 0700)

Any further ``public/frontend-*.key`` or ``public/executor-*.key`` is accepted too, so a frontend
or executor may hold a key of its own. ``--zmq-curve DIR`` (or ``$PAGEDSERVE_ZMQ_CURVE``) points
a process at the directory; ``pagedserve serve --zmq-curve`` without a directory makes throw-away
keys in its private socket directory. The launcher's supervisor socket (``ipc://`` in that 0700
directory, launcher and scheduler only) stays plain.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import stat
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

ENV_VAR = "PAGEDSERVE_ZMQ_CURVE"
FLAG = "--zmq-curve"
SERVER_ROLE = "scheduler"
CLIENT_ROLES = ("frontend", "executor")  # also the ZAP domains of the sockets they connect to
ROLES = (SERVER_ROLE, *CLIENT_ROLES)
EPHEMERAL = "ephemeral"  # ``serve --zmq-curve`` with no directory


@dataclass(frozen=True)
class CurveKeys:
    """One process's keys (z85 bytes). ``client_keys`` (the scheduler only): client role -> the
    public keys it accepts."""
    role: str
    directory: str
    public_key: bytes
    secret_key: bytes = field(repr=False)
    server_key: bytes
    client_keys: dict[str, frozenset[bytes]] = field(default_factory=dict)


def add_curve_argument(parser: argparse.ArgumentParser, *, serve: bool = False) -> None:
    help_text = (f"encrypt and authenticate the ZeroMQ sockets with CURVE keys from DIR (made by `pagedserve "
                 f"keys --out DIR`; default: ${ENV_VAR}, else plain ZeroMQ)")
    if serve:
        parser.add_argument(FLAG, nargs="?", const=EPHEMERAL, default=None, metavar="DIR",
                            help=help_text + "; without DIR, throw-away keys for this host's processes")
    else:
        parser.add_argument(FLAG, default=None, metavar="DIR", help=help_text)


def curve_dir(args: argparse.Namespace) -> str | None:
    """The key directory ``--zmq-curve`` or ``$PAGEDSERVE_ZMQ_CURVE`` names; None: plain ZeroMQ."""
    return getattr(args, "zmq_curve", None) or os.environ.get(ENV_VAR) or None


def create_keys(out_dir: str, force: bool = False) -> list[str]:
    """Write a keypair per role into ``out_dir`` (layout above); returns the files written.
    Raises ``ValueError`` if a secret key is there already and not ``force``."""
    public_dir, private_dir = os.path.join(out_dir, "public"), os.path.join(out_dir, "private")
    existing = [p for p in _secret_paths(private_dir) if os.path.exists(p)]
    if existing and not force:
        raise ValueError(f"{existing[0]} exists: keys are not overwritten (remove them, or pass --force)")
    os.makedirs(public_dir, exist_ok=True)
    os.makedirs(private_dir, mode=0o700, exist_ok=True)
    os.chmod(private_dir, 0o700)  # before any secret is written into it
    written = []
    for role in ROLES:
        public_tmp, secret = zmq.auth.create_certificates(private_dir, role)
        os.chmod(secret, 0o600)
        public = os.path.join(public_dir, f"{role}.key")
        shutil.move(public_tmp, public)
        os.chmod(public, 0o644)
        written += [public, secret]
    return written


def load_keys(directory: str, role: str) -> CurveKeys:
    """``role``'s keys from ``directory``; ``ValueError`` naming the file and ``--zmq-curve`` if
    something is missing, unreadable, or a secret key file is open to other users."""
    if not os.path.isdir(directory):
        raise ValueError(f"{FLAG} {directory}: no such directory (make one with `pagedserve keys --out DIR`)")
    secret_path = os.path.join(directory, "private", f"{role}.key_secret")
    public_key, secret_key = _read_certificate(secret_path, "this process's secret key")
    mode = stat.S_IMODE(os.stat(secret_path).st_mode)
    if mode & 0o077:
        raise ValueError(f"{FLAG}: {secret_path} is readable by other users (mode {mode:04o}); chmod 600 it")
    if secret_key is None:
        raise ValueError(f"{FLAG}: {secret_path} holds no secret-key")
    server_path = os.path.join(directory, "public", f"{SERVER_ROLE}.key")
    server_key, _ = _read_certificate(server_path, "the scheduler's public key")
    client_keys = {}
    if role == SERVER_ROLE:
        client_keys = {client: _allowed_keys(directory, client) for client in CLIENT_ROLES}
    return CurveKeys(role, directory, public_key, secret_key, server_key, client_keys)


def _read_certificate(path: str, what: str) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        missing = "missing" if not os.path.exists(path) else f"unreadable ({exc})"
        raise ValueError(f"{FLAG}: {path} ({what}) is {missing}; make keys with `pagedserve keys --out DIR`") from None


def _allowed_keys(directory: str, client_role: str) -> frozenset[bytes]:
    public_dir = os.path.join(directory, "public")
    paths = sorted({*glob.glob(os.path.join(public_dir, f"{client_role}.key")),
                    *glob.glob(os.path.join(public_dir, f"{client_role}-*.key"))})
    if not paths:
        raise ValueError(f"{FLAG}: no {client_role} public key in {public_dir} ({client_role}.key): the scheduler "
                         f"would refuse every {client_role}")
    return frozenset(_read_certificate(p, f"a {client_role}'s public key")[0] for p in paths)


def _secret_paths(private_dir: str) -> list[str]:
    return [os.path.join(private_dir, f"{role}.key_secret") for role in ROLES]


def secure_server(sock: zmq.Socket, keys: CurveKeys | None, client_role: str) -> None:
    """Make ``sock`` (before it binds) a CURVE server accepting ``client_role``'s keys; no-op if plain."""
    if keys is None:
        return
    sock.curve_server = True
    sock.curve_publickey = keys.public_key
    sock.curve_secretkey = keys.secret_key
    sock.zap_domain = client_role.encode()


def secure_client(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the scheduler; no-op if plain."""
    if keys is None:
        return
    sock.curve_publickey = keys.public_key
    sock.curve_secretkey = keys.secret_key
    sock.curve_serverkey = keys.server_key


class _AllowList:
    """The ZAP callback: a key on the domain's list passes; refusals are logged (1st, 2nd, 4th... per key)."""

    def __init__(self, client_keys: dict[str, frozenset[bytes]], log: Any) -> None:
        self.client_keys = client_keys
        self.log = log
        self.num_refusals: dict[bytes, int] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.client_keys.get(domain, ()):
            return True
        count = self.num_refusals[key] = self.num_refusals.get(key, 0) + 1
        if count & (count - 1) == 0:
            self.log.warning("zmq client refused: unknown CURVE key", domain=domain, client_key=key.decode(),
                             num_refusals=count)
        return False


def start_authenticator(context: zmq.Context, keys: CurveKeys | None, log: Any) -> ThreadAuthenticator | None:
    """Start the scheduler's ZAP handler on ``context`` (before its sockets bind); None if plain.
    ``stop()`` it before the context is destroyed."""
    if keys is None:
        return None
    auth = ThreadAuthenticator(context)
    auth.start()
    allow_list = _AllowList(keys.client_keys, log)
    for domain in CLIENT_ROLES:
        auth.configure_curve_callback(domain, credentials_provider=allow_list)
    return auth


def log_mode(log: Any, keys: CurveKeys | None) -> None:
    """Say at start-up which security the ZeroMQ sockets use."""
    if keys is None:
        log.info("zmq security", mode="plain", hint=f"{FLAG} DIR encrypts and authenticates the ZeroMQ sockets")
        return
    allowed = {role: len(k) for role, k in keys.client_keys.items()}
    log.info("zmq security", mode="curve", role=keys.role, key_dir=keys.directory,
             public_key=keys.public_key.decode(), **({"num_allowed_keys": allowed} if allowed else {}))
