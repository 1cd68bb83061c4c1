"""Named POSIX shared-memory segments of a rank group: create, attach, header words, cleanup.

A segment is the file ``/dev/shm/psv-{group_id}-r{rank}``, created by its rank with ``os.open``
and mapped with ``mmap``. Not ``multiprocessing.shared_memory``: in Python 3.11 a
``SharedMemory`` registers every segment it creates *or attaches* with the resource tracker, which
unlinks it when that process exits and warns about a "leak" — a rank that attached a peer's
segment would delete it. Plain files keep ownership explicit.

Lifetime: once every rank has mapped every segment (the connect handshake in ``shm``), every rank
unlinks all the group's names; from then on a segment lives exactly as long as a mapping of it, so
nothing is left in ``/dev/shm`` whichever way the processes end (``kill -9`` included). Before that point
a name is removed by its owner's ``close``, by an ``atexit`` hook, by any rank that sees the group
fail, and by ``cleanup_group(group_id)``, which a launcher runs once the group has ended.

Header: int64 words at the start of the segment (layout below), then the data at ``DATA_OFFSET``.
Only the owner writes its header; peers read it.
"""

from __future__ import annotations

import atexit
import glob
import mmap
import os
import re

SHM_DIR = "/dev/shm"
PREFIX = "psv-"
MAGIC = int.from_bytes(b"psvshm01", "little")  # the segment really is one of ours
HEADER_BYTES = 4096
DATA_OFFSET = HEADER_BYTES

# Header words (int64 index). The epoch and the slot metadata share one cache line, written by
# the owner (metadata first, then the epoch) and polled by the peers.
W_MAGIC, W_CONNECTED, W_STATUS, W_CAUSE = 0, 1, 2, 3  # CAUSE: the rank an abort blames
W_REASON_BYTES = 4  # length of the abort's reason, utf-8 at REASON_OFFSET
REASON_OFFSET, REASON_MAX_BYTES = 512, 1024
W_EPOCH, W_META = 8, 9  # W_META + slot: (numel << 8) | dtype code of the data in that slot
STATUS_RUNNING, STATUS_CLOSED, STATUS_ABORTED = 0, 1, 2

_GROUP_ID = re.compile(r"^[A-Za-z0-9_]{1,64}$")
_owned: set[str] = set()  # names this process created and has not unlinked yet


def segment_name(group_id: str, rank: int) -> str:
    if not _GROUP_ID.match(group_id):
        raise ValueError(f"group id {group_id!r} must be 1-64 letters, digits or underscores")
    return f"{PREFIX}{group_id}-r{rank}"


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def unlink_quietly(name: str) -> bool:
    """Remove ``name`` from ``/dev/shm``; ``False`` when it was already gone."""
    _owned.discard(name)
    try:
        os.unlink(_path(name))
        return True
    except FileNotFoundError:
        return False


def cleanup_group(group_id: str) -> list[str]:
    """Unlink every segment of ``group_id`` still named in ``/dev/shm``; returns their names.

    Safe after the group has ended (or failed); a rank still starting up loses its peers' names.
    """
    segment_name(group_id, 0)  # validates the id, so the pattern below cannot escape the group
    removed = []
    for path in glob.glob(_path(f"{PREFIX}{group_id}-r*")):
        name = os.path.basename(path)
        if unlink_quietly(name):
            removed.append(name)
    return removed


@atexit.register
def _unlink_owned_at_exit() -> None:
    for name in list(_owned):
        unlink_quietly(name)


class Segment:
    """One mapped segment: ``words`` is its int64 header, ``mm`` the whole mapping."""

    def __init__(self, name: str, fd: int, size_bytes: int) -> None:
        self.name = name
        self.size_bytes = size_bytes
        try:
            self.mm = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        self.words = memoryview(self.mm)[:HEADER_BYTES].cast("q")

    @classmethod
    def create(cls, name: str, size_bytes: int) -> "Segment":
        """Create and map a new zero-filled segment owned by this process."""
        try:
            fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise FileExistsError(f"shared-memory segment {name} already exists (a group with this id "
                                  f"is running, or crashed: run cleanup_group)") from None
        _owned.add(name)
        try:
            os.ftruncate(fd, size_bytes)
        except OSError:
            os.close(fd)
            unlink_quietly(name)
            raise
        segment = cls(name, fd, size_bytes)
        segment.words[W_MAGIC] = MAGIC
        return segment

    @classmethod
    def attach(cls, name: str, size_bytes: int) -> "Segment":
        """Map a peer's segment; raises ``FileNotFoundError`` when it is gone."""
        fd = os.open(_path(name), os.O_RDWR)
        actual = os.fstat(fd).st_size
        if actual != size_bytes:
            os.close(fd)
            raise ValueError(f"segment {name} holds {actual} bytes, its handle says {size_bytes}")
        segment = cls(name, fd, size_bytes)
        if segment.words[W_MAGIC] != MAGIC:
            segment.close()
            raise ValueError(f"segment {name} is not a pagedserve group segment")
        return segment

    def unlink(self) -> None:
        unlink_quietly(self.name)

    def close(self) -> None:
        """Unmap; tensors viewing the mapping must be dropped first (else it stays mapped)."""
        self.words.release()
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass


def process_identity() -> tuple[int, int, str]:
    """(pid, start time in clock ticks, pid namespace) of this process: pid reuse cannot fool it."""
    pid = os.getpid()
    return pid, _start_ticks(pid) or 0, _pid_namespace()


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """Field 22 of ``/proc/<pid>/stat``; ``None`` when the process is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # the command name may hold spaces
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def process_alive(pid: int, start_ticks: int, pid_namespace: str) -> bool:
    """Whether the process is running; assumed alive when it lives in another pid namespace."""
    if pid_namespace != _pid_namespace():
        return True
    ticks = _start_ticks(pid)
    return ticks is not None and (start_ticks == 0 or ticks == start_ticks)
