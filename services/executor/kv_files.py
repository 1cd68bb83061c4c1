"""The disk tier's files (``--kv-offload-dir``): one file per KV block per rank, named by the block's
prefix hash, in a subdirectory named by a digest of everything that changes the bytes.

Layout: ``DIR/<digest>/manifest.json`` (what the digest covers, for a reader) and
``DIR/<digest>/<hash hex>.kv``. A file is a header, ``MAGIC``, the digest (16 bytes), the hash
(16 bytes), the payload's length (8 bytes, little-endian) and its BLAKE2b-256 checksum (32 bytes),
then the payload: the block's keys then values, every layer, raw bytes. ``read`` refuses (returns
None, and says why) a missing, short, foreign (another digest or hash) or corrupt file, so that
nothing but the bytes the hash names is ever served.

Writes are atomic: the bytes go to a temporary file named for this process and a random token
(``.tmp-<pid>-<hex>``) and are renamed over the final name (``os.replace``), so a reader sees a
whole file or none, and two servers sharing a directory never write into each other's files (each
keeps its own index and bound; one may delete a file the other then finds missing: a miss).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
from pathlib import Path

MAGIC = b"PSKVBLK1"
_HEADER = struct.Struct("<8s16s16sQ32s")
HEADER_BYTES = _HEADER.size
SUFFIX = ".kv"


def cache_digest(fields: dict) -> str:
    """32 hex digits over ``fields`` (JSON, sorted keys): the name of the subdirectory."""
    return hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=16).hexdigest()


def weights_fingerprint(state_dict: dict) -> str:
    """A cheap identity of the weights: every tensor's name, type and shape and its first and last
    4 KiB (random weights of another seed, or another checkpoint, differ there)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state_dict):
        t = state_dict[name]
        h.update(f"{name}:{getattr(t, 'dtype', type(t).__name__)}:{tuple(getattr(t, 'shape', ()))}".encode())
        try:
            raw = t.detach().reshape(-1).contiguous().view(-1).cpu().numpy().view("u1")
        except (AttributeError, RuntimeError, TypeError):
            continue  # not a plain tensor (a packed quantized one): its name and shape count
        h.update(raw[:4096].tobytes())
        h.update(raw[-4096:].tobytes())
    return h.hexdigest()


class BlockFiles:
    """The files of one digest in one directory (created, and checked writable, here)."""

    def __init__(self, root: str | os.PathLike, fields: dict) -> None:
        self.root = Path(root)
        self.digest = cache_digest(fields)
        self.dir = self.root / self.digest
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            manifest = self.dir / "manifest.json"
            if not manifest.exists():
                self._atomic_write(manifest, json.dumps(fields, indent=1, sort_keys=True).encode())
            probe = self.dir / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ValueError(f"--kv-offload-dir {root}: not a writable directory ({exc.strerror or exc})") from None
        self._digest_bytes = bytes.fromhex(self.digest)

    def path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + SUFFIX)

    def write(self, key: bytes, payload: bytes) -> None:
        """Write ``payload`` as ``key``'s file, atomically; raises OSError (a full disk...)."""
        checksum = hashlib.blake2b(payload, digest_size=32).digest()
        header = _HEADER.pack(MAGIC, self._digest_bytes, key, len(payload), checksum)
        self._atomic_write(self.path(key), header + payload)

    def _atomic_write(self, path: Path, data: bytes) -> None:
        tmp = path.with_name(f".tmp-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def read(self, key: bytes, payload_bytes: int) -> tuple[bytes | None, str]:
        """``key``'s payload, or None and why not (missing, truncated, foreign, corrupt)."""
        try:
            data = self.path(key).read_bytes()
        except OSError as exc:
            return None, f"missing ({exc.strerror or exc})"
        if len(data) != HEADER_BYTES + payload_bytes:
            return None, f"truncated or of another size ({len(data)} bytes, expected {HEADER_BYTES + payload_bytes})"
        magic, digest, file_key, length, checksum = _HEADER.unpack_from(data)
        if magic != MAGIC or digest != self._digest_bytes or file_key != key or length != payload_bytes:
            return None, "foreign (another format, digest or block)"
        payload = data[HEADER_BYTES:]
        if hashlib.blake2b(payload, digest_size=32).digest() != checksum:
            return None, "corrupt (checksum mismatch)"
        return payload, ""

    def delete(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)

    def listing(self, payload_bytes: int) -> tuple[list[bytes], list[str]]:
        """Keys of the files of the right size here, oldest first; and the names ignored (another
        size: truncated; not a block file)."""
        found, ignored = [], []
        for entry in os.scandir(self.dir):
            name = entry.name
            if name == "manifest.json" or name.startswith("."):
                continue
            stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else ""
            try:
                key = bytes.fromhex(stem)
                st = entry.stat()
            except (ValueError, OSError):
                key, st = b"", None
            if len(key) != 16 or st is None or st.st_size != HEADER_BYTES + payload_bytes:
                ignored.append(name)
                continue
            found.append((st.st_mtime_ns, name, key))
        return [key for _, _, key in sorted(found)], ignored

    def foreign_digests(self) -> list[str]:
        """Subdirectories of other digests (another model, type, block shape or rank)."""
        return sorted(e.name for e in os.scandir(self.root) if e.is_dir() and e.name != self.digest)
