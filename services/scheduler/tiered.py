"""The scheduler with KV offload tiers (``kv_tiers``, ``tier_admission``): each step carries the
tiers' moves in order (``Step.tier_ops``), a waiting sequence whose prefix is on disk steps aside
while its blocks load (the rest of the batch goes on) and comes back at the head of the queue once
the executors report them loaded or failed (``StepResult.tier_loaded`` ...). Plain Python, no I/O."""

from __future__ import annotations

from shared.messages import Step, StepResult

from .kv_tiers import TierIndex
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from .step_builder import build_step
from .prefix import prefix_hits
from .tier_admission import request_loads, revive_host_hits

MAX_LOAD_ROUNDS = 64  # a sequence waits for at most this many rounds of loads (each loads a block or more)


class TieredScheduler(Scheduler):
    def __init__(self, config, block_manager) -> None:
        super().__init__(config, block_manager)
        assert block_manager.tiers is not None, "a TieredScheduler needs a block manager with tiers"
        self.parked: list[Sequence] = []  # waiting for their blocks to load from disk
        self._pins: list[tuple[Sequence, list[bytes]]] = []  # host copies kept for waiting sequences

    def has_work(self) -> bool:
        return super().has_work() or bool(self.parked)

    def schedule(self) -> Step | None:
        self._park_for_loads()
        step = super().schedule()
        self._unpin_admitted()
        ops, keys = self.blocks.tiers.take_ops()
        if step is None and len(ops):  # only moves: a step of no sequence carries them
            step = build_step(next(self._step_ids), [], self.blocks, self._freed_seq_ids, [], [])
            self._freed_seq_ids = []
            self._in_flight.add(step.step_id, [])
        if step is not None:
            step.tier_ops, step.tier_keys = ops, keys
        return step

    def _park_for_loads(self) -> None:
        """Waiting sequences (those that could be admitted soon) whose prefix continues on disk
        ask for its blocks and step aside. One back from a round of loads first takes the blocks
        loaded to the device (their host slots may then take the next ones: a prefix longer than
        the host tier comes in several rounds)."""
        for seq in list(self.waiting)[: self.config.max_num_seqs]:
            if seq.tier_rounds >= MAX_LOAD_ROUNDS:
                continue
            if seq.tier_rounds:
                revive_host_hits(self.blocks, seq, prefix_hits(self.blocks, seq))
                self._unpin(lambda s: s is seq)
            if request_loads(self.blocks, seq):
                seq.tier_rounds += 1
                self.waiting.remove(seq)
                self.parked.append(seq)
                hashes = list(seq.block_hashes)
                self.blocks.tiers.pin(hashes)  # until it is admitted: other evictions keep off them
                self._pins.append((seq, hashes))

    def _unpin_admitted(self) -> None:
        self._unpin(lambda seq: seq.status is not SequenceStatus.WAITING)

    def _unpin(self, which) -> None:
        for seq, hashes in [p for p in self._pins if which(p[0])]:
            self.blocks.tiers.unpin(hashes)
            self._pins.remove((seq, hashes))

    def update(self, result: StepResult) -> None:
        super().update(result)
        tiers = self.blocks.tiers
        for keys, done, ok in ((result.tier_loaded, tiers.on_loaded, True),
                               (result.tier_load_failed, tiers.on_loaded, False),
                               (result.tier_stored, tiers.on_stored, True),
                               (result.tier_store_failed, tiers.on_stored, False)):
            for h in keys:
                done(h, ok)
        ready = [s for s in self.parked if not any(h in tiers.loading for h in s.block_hashes)]
        if ready:
            self.parked = [s for s in self.parked if s not in ready]
            self.waiting.extendleft(reversed(ready))  # they were at the head when they stepped aside

    def _dequeue(self, seq: Sequence) -> None:
        if seq in self.parked:
            self.parked.remove(seq)
        else:
            super()._dequeue(seq)

    def reset_executor_state(self, cause: str) -> None:
        self.waiting.extendleft(reversed(self.parked))  # the loads went with the executors
        self.parked = []
        super().reset_executor_state(cause)


def scheduler_class(blocks, num_host_blocks: int, num_disk_blocks: int = 0, stored_keys: list[bytes] = ()) -> type:
    """``TieredScheduler`` over ``blocks`` with the executors' tiers (the books set on ``blocks``,
    the files found at start adopted), or the plain ``Scheduler`` when they have no host tier or
    the pool caches no prefix (or is the contiguous baseline)."""
    from .contiguous import ContiguousBlockManager

    if num_host_blocks <= 0 or not blocks.enable_prefix_caching or isinstance(blocks, ContiguousBlockManager):
        return Scheduler
    blocks.tiers = TierIndex(num_host_blocks, num_disk_blocks)
    blocks.tiers.adopt(list(stored_keys))
    return TieredScheduler


def keys_on_every_rank(readies) -> list[bytes]:
    """The block files every rank found at start (each holds its shard), in the first's order."""
    common = set(readies[0].offloaded_keys).intersection(*(r.offloaded_keys for r in readies[1:]))
    return [k for k in readies[0].offloaded_keys if k in common]
