"""The flag words of a rank group and how a rank waits on them: ``PeerFlags``, ``WaitPolicy``.

Each rank writes only its own segment's header (``segment``: epoch, slot metadata, connected,
status, cause, reason) and polls its peers'. Waiting spins briefly (``WaitPolicy.spin_s``), then
yields the CPU between checks (``os.sched_yield``), then sleeps in short naps. A yield on an idle
core returns at once, so ranks with a core each still answer in microseconds; ranks that share
cores (more ranks than cores, or a loaded machine) hand the core to the peer they wait for
instead of starving it. Measured on a loaded 2-core machine (``python -m loadtest.kernels.allreduce
--policies``): longer spins lose badly with 3 ranks on 2 cores and gain nothing with 2; sleeping
on a futex instead of yielding was no faster there, so the simple loop stays.

Past the spin, the lagging peers are checked every ``check_interval_s``: a peer that closed,
aborted, died (pid gone or a zombie; pid reuse is caught by the start time) or did not arrive
within ``timeout_s`` makes ``fail`` raise ``GroupError`` naming it. ``fail`` first ``abort``s:
marks this rank aborted with the culprit's rank and a reason, so that the other ranks report the
same rank and why, and unlinks the group's names from ``/dev/shm``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import NoReturn

from .base import GroupError
from .segment import (
    REASON_MAX_BYTES, REASON_OFFSET, STATUS_ABORTED, STATUS_CLOSED, W_CAUSE, W_CONNECTED, W_EPOCH, W_META,
    W_REASON_BYTES, W_STATUS, cleanup_group, process_alive,
)


@dataclass(frozen=True)
class WaitPolicy:
    """How a rank waits for its peers: spin, then yield, then nap; give up after ``timeout_s``."""

    spin_s: float = 2e-5  # check the flags in a tight loop this long first
    yield_s: float = 0.002  # then os.sched_yield() between checks until this long
    sleep_s: float = 5e-5  # then time.sleep(sleep_s) between checks
    check_interval_s: float = 0.02  # how often lagging peers are checked for death
    timeout_s: float = 60.0  # a peer this late is declared hung

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or min(self.spin_s, self.yield_s, self.sleep_s) < 0:
            raise ValueError(f"bad wait policy {self}")


class PeerFlags:
    """Rank ``rank``'s own header words (``own``) and its peers' (rank, words, handle) in ``peers``."""

    def __init__(self, own_words: memoryview, group_id: str, rank: int, policy: WaitPolicy) -> None:
        self.own, self.group_id, self.rank = own_words, group_id, rank
        self.peers: list[tuple[int, memoryview, dict]] = []
        self.error: GroupError | None = None
        self._all_reached = 0  # every peer is known to have published this epoch
        self.policy = policy  # may be replaced between collectives

    def publish(self, epoch: int, slot: int, meta: int) -> None:
        """Metadata first, then the epoch: a peer that sees the epoch sees the metadata."""
        self.own[W_META + slot] = meta
        self.own[W_EPOCH] = epoch

    def connect(self) -> None:
        """Say this rank has mapped every segment; wait until every peer says so."""
        self.own[W_CONNECTED] = 1
        self.wait_all(W_CONNECTED, 1, "connect")

    def close(self) -> None:
        if self.error is None:
            self.own[W_STATUS] = STATUS_CLOSED

    def check_meta(self, slot: int, expect: int, describe) -> None:
        """Fail naming the first peer whose slot metadata is not ``expect`` (``describe(rank, meta)``)."""
        for r, words, _ in self.peers:
            meta = words[W_META + slot]
            if meta != expect:
                self.fail(describe(r, meta), r)

    def wait_epoch(self, epoch: int) -> None:
        """Until every peer has published ``epoch``: spin, then ``wait_all``."""
        if self._all_reached >= epoch:
            return
        clock = time.perf_counter
        until = clock() + self.policy.spin_s
        while True:
            for _r, words, _h in self.peers:
                if words[W_EPOCH] < epoch:
                    break
            else:
                self._all_reached = epoch
                return
            if clock() > until:
                break
        self.wait_all(W_EPOCH, epoch, f"collective {epoch}")
        self._all_reached = epoch

    def wait_all(self, word: int, value: int, what: str) -> None:
        """Until every peer's header ``word`` >= ``value``: yield, nap, check the laggards."""
        policy = self.policy
        start = now = time.monotonic()
        next_check = now
        while True:
            lagging = [(r, words, h) for r, words, h in self.peers if words[word] < value]
            if not lagging:
                return
            if now >= next_check:
                self._check_lagging(lagging, word, value, what, now - start)
                next_check = now + policy.check_interval_s
            if now - start < policy.yield_s:
                os.sched_yield()
            else:
                time.sleep(policy.sleep_s)
            now = time.monotonic()

    def _check_lagging(self, lagging, word: int, value: int, what: str, waited_s: float) -> None:
        """Fail naming the first peer still short of ``value`` that aborted, closed, died or is late.

        A peer seen lagging may have arrived since, then closed or exited (it was done). So whether
        it lives is asked first, then its status is read, then whether it arrived: a peer found gone
        has written its last words before, and one that arrived is not blamed. (Asked last, a peer
        that arrived, closed and exited between the reads and the question was blamed as dead: a
        4-rank test group failed so on a loaded machine, the blamed rank's exit status 0.)"""
        late = []
        for r, words, h in lagging:
            alive = process_alive(h["pid"], h["pid_start"], h["pid_ns"])
            status = words[W_STATUS]
            if words[word] >= value:
                continue
            late.append(r)
            if status == STATUS_ABORTED:
                cause = words[W_CAUSE]
                reason = bytes(words.cast("B")[REASON_OFFSET:REASON_OFFSET + words[W_REASON_BYTES]])
                by = "" if cause == r else f" (reported by rank {r})"
                self.fail(f"rank {cause} failed{by}: {reason.decode(errors='replace')}; rank {self.rank} "
                          f"was at {what}", None if cause < 0 else cause)
            if status == STATUS_CLOSED:
                self.fail(f"rank {r} closed while rank {self.rank} waited for it at {what}", r)
            if not alive:
                self.fail(f"rank {r} (pid {h['pid']}) died; rank {self.rank} was at {what}", r)
        if late and waited_s > self.policy.timeout_s:
            self.fail(f"ranks {late} did not reach {what} within {self.policy.timeout_s:g} s "
                      f"(rank {self.rank} waited {waited_s:.1f} s)", late[0])

    def abort(self, message: str, rank: int | None) -> GroupError:
        """Tell the peers the group is over, who is at fault and why; unlink the group's names."""
        if self.error is None:
            self.error = GroupError(message, rank)
            reason = message.encode()[:REASON_MAX_BYTES]
            self.own.cast("B")[REASON_OFFSET:REASON_OFFSET + len(reason)] = reason
            self.own[W_REASON_BYTES] = len(reason)
            self.own[W_CAUSE] = -1 if rank is None else rank
            self.own[W_STATUS] = STATUS_ABORTED
            cleanup_group(self.group_id)
        return self.error

    def fail(self, message: str, rank: int | None) -> NoReturn:
        """``abort``, then raise the ``GroupError``."""
        raise self.abort(message, rank)
