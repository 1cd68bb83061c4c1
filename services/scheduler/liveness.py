"""Which executor ranks the scheduler may use: the policy half of its executor link. Plain Python,
no I/O; times are passed in (``time.monotonic()`` seconds).

A rank is *accepted* when its process answers this scheduler's ``Hello`` (an ``ExecutorReady``
carrying our epoch); the group is ready when every rank is accepted. An accepted rank is *lost*
when its process
- was replaced: a ``Heartbeat`` or ``ExecutorReady`` from a new incarnation of the rank;
- stopped beating: no ``Heartbeat`` for ``heartbeat_timeout_s`` (dead, or stopped);
- or a step is overdue: no result ``step_timeout_s`` after it went out (the process may still
  beat while its step is stuck). With two steps out (async scheduling) the second one's clock
  starts when the first one's result comes: the ranks run one step at a time.
A stall of the scheduler's own (``excuse``) does not count as the ranks' silence.
Losing one rank loses the group: tensor-parallel ranks block in collectives when one is gone, so
every rank must be restarted and answer again, and a lost process is never accepted again (its
incarnation is *retired*; ``last_retired`` names the last few groups' to the executors, so that
one still running exits and is replaced). The first group's pool shape is the one every later
group must have (``ShapeMismatch`` otherwise).
Each complete group also yields ``stats`` (``group_stats``: world size, all-reduce kind, KV blocks
and bytes per rank), the ``EngineStats`` fields that describe it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages import ExecutorHealth, ExecutorReady, Heartbeat


RETIRED_KEPT_GROUPS = 4  # Hello names the processes of this many lost groups at most


class ShapeMismatch(ValueError):
    """A restarted executor group's KV pool differs from the first one's: the scheduler cannot go on."""


@dataclass(frozen=True)
class PoolShape:
    """What the scheduler's block manager was built for: the smallest pool over the ranks."""

    model: str
    block_size: int
    num_blocks: int
    max_model_len: int
    num_cpu_blocks: int
    sliding_window: int = 0  # tokens every layer attends back (0: all); the same on every rank
    num_host_offload_blocks: int = 0  # the KV offload tiers' sizes (kv_tiers.py)
    num_disk_offload_blocks: int = 0

    @classmethod
    def of(cls, readies: list[ExecutorReady]) -> "PoolShape":
        first = readies[0]
        return cls(first.model, first.block_size, min(r.num_blocks for r in readies),
                   min(r.max_model_len for r in readies), min(r.num_cpu_blocks for r in readies),
                   max(r.sliding_window for r in readies) if all(r.sliding_window for r in readies) else 0,
                   min(r.num_host_offload_blocks for r in readies), min(r.num_disk_offload_blocks for r in readies))


@dataclass(frozen=True)
class Loss:
    """The group is lost; ``rank`` is the one at fault."""

    rank: int
    cause: str


@dataclass
class RankState:
    rank: int
    incarnation: int = 0  # the accepted process (0: none)
    pid: int = 0  # the latest process heard of for this rank
    last_beat: float | None = None  # of the accepted process, or of the latest one before that
    ready: ExecutorReady | None = None
    num_restarts: int = 0


@dataclass
class ExecutorGroup:
    world_size: int
    heartbeat_timeout_s: float
    step_timeout_s: float
    shape: PoolShape | None = None  # the first group's; later groups must match it
    stats: dict = field(init=False)  # the latest complete group's (``group_stats``); its size before
    ranks: list[RankState] = field(init=False)
    _retired: set[int] = field(default_factory=set)  # incarnations lost: never accepted again
    last_retired: list[int] = field(default_factory=list)  # of the last few groups lost (for ``Hello``)
    _step_sent_at: float | None = None  # when the oldest step out became the ranks' to answer
    _num_steps_out: int = 0

    def __post_init__(self) -> None:
        self.ranks = [RankState(rank) for rank in range(self.world_size)]
        self.stats = {"world_size": self.world_size}

    @property
    def ready(self) -> bool:
        return all(state.incarnation for state in self.ranks)

    def on_ready(self, msg: ExecutorReady, epoch: int, now: float) -> Loss | None:
        """A rank says it is loaded. Accepted when it answers ``epoch``; a loss when it is a new
        process of an accepted rank. Raises ``ShapeMismatch`` when the group it completes does not
        have the first group's shape."""
        loss = self._check_incarnation(msg.rank, msg.incarnation, msg.pid, now)
        state = self._state(msg.rank)
        if loss is not None or state is None or msg.epoch != epoch or msg.incarnation in self._retired:
            return loss
        state.incarnation, state.pid, state.last_beat, state.ready = msg.incarnation, msg.pid, now, msg
        if self.ready:
            self._check_shape()
        return None

    def accepted(self, rank: int, incarnation: int) -> bool:
        state = self._state(rank)
        return state is not None and state.incarnation == incarnation

    def on_heartbeat(self, msg: Heartbeat, now: float) -> Loss | None:
        return self._check_incarnation(msg.rank, msg.incarnation, msg.pid, now)

    def _check_incarnation(self, rank: int, incarnation: int, pid: int, now: float) -> Loss | None:
        state = self._state(rank)
        if state is None or incarnation in self._retired:
            return None  # not ours, or a lost process still talking
        if state.incarnation and incarnation != state.incarnation:
            return Loss(rank, f"rank {rank} was restarted: a new process (pid {pid}) replaced pid {state.pid}")
        if not state.incarnation:
            state.pid = pid  # a process starting up, not yet accepted
        state.last_beat = now
        return None

    def _state(self, rank: int) -> RankState | None:
        return self.ranks[rank] if 0 <= rank < self.world_size else None

    def _check_shape(self) -> None:
        self.stats = group_stats({state.rank: state.ready for state in self.ranks}, self.world_size)
        shape = PoolShape.of([state.ready for state in self.ranks])
        if self.shape is None:
            self.shape = shape
        elif shape != self.shape:
            raise ShapeMismatch(f"the restarted executors' KV pool {shape} differs from the first one's "
                                f"{self.shape}; the scheduler cannot resume its sequences on it")

    def excuse(self, stall_s: float) -> None:
        """The scheduler itself was stalled for ``stall_s`` (stopped, or starved of CPU): what it
        did not read meanwhile is not the ranks' silence, so every clock moves on by as much."""
        for state in self.ranks:
            if state.last_beat is not None:
                state.last_beat += stall_s
        if self._step_sent_at is not None:
            self._step_sent_at += stall_s

    def step_sent(self, now: float) -> None:
        if not self._num_steps_out:
            self._step_sent_at = now
        self._num_steps_out += 1

    def step_done(self, now: float) -> None:
        """The oldest step out was answered (at ``now``): the next one out, if any, runs from now."""
        self._num_steps_out = max(0, self._num_steps_out - 1)
        self._step_sent_at = now if self._num_steps_out else None

    def check(self, now: float) -> Loss | None:
        """The loss to declare now: an accepted rank silent too long, or the step in flight overdue."""
        for state in self.ranks:
            if state.incarnation and now - state.last_beat > self.heartbeat_timeout_s:
                silence_s = now - state.last_beat
                return Loss(state.rank, f"no heartbeat from rank {state.rank} (pid {state.pid}) for {silence_s:.1f} s "
                                        f"(--heartbeat-timeout {self.heartbeat_timeout_s:g})")
        if self._step_sent_at is not None and now - self._step_sent_at > self.step_timeout_s:
            return Loss(0, f"a step is overdue: no result {now - self._step_sent_at:.1f} s after it went out "
                           f"(--step-timeout {self.step_timeout_s:g})")
        return None

    def lose(self, loss: Loss) -> list[tuple[int, int]]:
        """Give up every rank's process (the group restarts whole), counting a restart of the rank at
        fault; returns (rank, pid) of each process the supervisor should replace."""
        self.ranks[loss.rank].num_restarts += 1
        replaced = []
        lost = [state.incarnation for state in self.ranks if state.incarnation]
        self.last_retired = (self.last_retired + lost)[-RETIRED_KEPT_GROUPS * self.world_size:]
        for state in self.ranks:
            if state.incarnation:
                self._retired.add(state.incarnation)
            if state.pid:
                replaced.append((state.rank, state.pid))
            state.incarnation, state.ready = 0, None
        self._step_sent_at, self._num_steps_out = None, 0
        return replaced

    def health(self, now: float) -> list[ExecutorHealth]:
        return [ExecutorHealth(state.rank, state.pid, "ok" if state.incarnation else self._waiting_status(state),
                               -1.0 if state.last_beat is None else round(now - state.last_beat, 3),
                               state.num_restarts)
                for state in self.ranks]

    @staticmethod
    def _waiting_status(state: RankState) -> str:
        return "lost" if state.num_restarts else "starting"


def group_stats(ready: dict[int, ExecutorReady], world_size: int) -> dict:
    """The ``EngineStats`` fields that describe the group, from every rank's ``ExecutorReady``.

    Raises ``ValueError`` when the ranks disagree with the scheduler or each other about the group."""
    ranks = [ready[r] for r in sorted(ready)]
    for r in ranks:
        if r.world_size != world_size:
            raise ValueError(f"executor rank {r.rank} reports --world-size {r.world_size}; the scheduler has "
                             f"--world-size {world_size}")
        if r.block_size != ranks[0].block_size:
            raise ValueError(f"executor rank {r.rank} has --block-size {r.block_size}, rank {ranks[0].rank} "
                             f"{ranks[0].block_size}")
    return {"world_size": world_size, "all_reduce": ranks[0].all_reduce,
            "num_kv_blocks_per_rank": [r.num_blocks for r in ranks],
            "kv_cache_bytes_per_rank": [r.kv_cache_bytes for r in ranks],
            "kv_cache_dtype": ranks[0].kv_cache_dtype, "kv_block_size": ranks[0].block_size}
