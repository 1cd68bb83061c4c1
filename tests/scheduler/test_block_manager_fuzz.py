"""A hypothesis state machine over the block manager: conservation holds after every operation
(speculative decoding's rollback among them); and a windowed variant whose sequences also drop the blocks out of a sliding window;
and a variant with KV offload tiers whose moves are modelled on the blocks' contents."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_tiers import TierIndex, TierOp
from services.scheduler.prefix import prefix_hits
from services.scheduler.sequence import Sequence
from services.scheduler.sliding_window import NULL_BLOCK
from services.scheduler.tier_admission import request_loads, revive_host_hits
from shared.messages import SamplingParams

BLOCK_SIZE = 4
TOKENS = st.lists(st.integers(1, 3), min_size=1, max_size=14)  # a tiny alphabet: many shared prefixes


class BlockManagerMachine(RuleBasedStateMachine):
    WINDOW = 0  # no sliding window

    @initialize(num_blocks=st.integers(4, 12), num_cpu_blocks=st.integers(0, 8))
    def setup(self, num_blocks, num_cpu_blocks):
        self.bm = BlockManager(num_blocks, BLOCK_SIZE, watermark=0.0, num_cpu_blocks=num_cpu_blocks,
                               sliding_window=self.WINDOW)
        self.seqs: dict[int, list[int]] = {}  # seq id -> its tokens (all computed)
        self.swapped: dict[int, list[int]] = {}
        self.next_id = 0
        self.content: dict[int, list] = {}  # device block -> the tokens written into its slots
        self.cpu_content: dict[int, list] = {}

    def _write(self, seq_id, tokens, start):
        """Model the executor: write tokens[start:] into their slots; never into a shared block."""
        table = self.bm.block_tables[seq_id]
        for pos in range(start, len(tokens)):
            block_id = table[pos // BLOCK_SIZE]
            assert self.bm.ref_counts[block_id] == 1, f"write into shared block {block_id}"
            self.content.setdefault(block_id, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = tokens[pos]

    def _register(self, seq_id):
        tokens = self.seqs[seq_id]
        full = len(tokens) // BLOCK_SIZE
        self.bm.cache_full_blocks(seq_id, self.bm.prefix_hashes(tokens, full))

    @rule(tokens=TOKENS)
    def allocate(self, tokens):
        hashes = self.bm.prefix_hashes(tokens, (len(tokens) - 1) // BLOCK_SIZE)
        hits = self.bm.match_prefix(hashes, len(tokens))
        seq_id, self.next_id = self.next_id, self.next_id + 1
        if self.bm.allocate_slots(seq_id, len(tokens), len(hits) * BLOCK_SIZE, hits):
            for i, block_id in enumerate(hits):  # a hit holds exactly these tokens
                assert self.content[block_id] == tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
            self.seqs[seq_id] = list(tokens)
            self._write(seq_id, tokens, len(hits) * BLOCK_SIZE)
            self._register(seq_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(1, 3), min_size=1, max_size=6))
    def append(self, data, new):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs[seq_id]
        if self.bm.allocate_slots(seq_id, len(tokens) + len(new), num_computed_tokens=len(tokens)):
            for src, dst in self.bm.take_copies():
                assert self.bm.ref_counts[dst] == 1 and src != dst
                self.content[dst] = list(self.content[src])
            start = len(tokens)
            tokens.extend(new)
            self._write(seq_id, tokens, start)
            self._register(seq_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.integers(1, 3), drafts=st.lists(st.integers(1, 3), min_size=1, max_size=5),
          accept=st.integers(0, 5))
    def speculate(self, data, new, drafts, accept):
        """Speculative decoding: a step feeds one token and drafts after it into allocated slots;
        the first ``accept`` drafts are kept, the rest rolled back (``free_tail``); only the kept
        tokens' full blocks are registered (a later hit must read exactly them)."""
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = self.seqs[seq_id]
        fed = [new, *drafts]
        if self.bm.allocate_slots(seq_id, len(tokens) + len(fed), num_computed_tokens=len(tokens)):
            for src, dst in self.bm.take_copies():
                self.content[dst] = list(self.content[src])
            start = len(tokens)
            self._write(seq_id, tokens + fed, start)
            tokens.extend(fed[:1 + min(accept, len(drafts))])
            self.bm.free_tail(seq_id, len(tokens))
            assert len(self.bm.block_tables[seq_id]) == self.bm.blocks_needed(len(tokens))
            self._register(seq_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.seqs[child] = list(self.seqs[parent])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(seq_id)
        del self.seqs[seq_id]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        if self.bm.can_swap_out([seq_id]):
            for dev, cpu in self.bm.swap_out([seq_id]):
                self.cpu_content[cpu] = list(self.content[dev])
            self.swapped[seq_id] = self.seqs.pop(seq_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        if self.bm.can_swap_in([seq_id]):
            for cpu, dev in self.bm.swap_in([seq_id]):
                self.content[dev] = list(self.cpu_content[cpu])
            self.seqs[seq_id] = self.swapped.pop(seq_id)

    @precondition(lambda self: self.WINDOW and self.seqs)
    @rule(data=st.data())
    def trim(self, data):
        """Drop a sequence's blocks out of the window (all its tokens are computed)."""
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free_out_of_window(seq_id, len(self.seqs[seq_id]))

    @rule(num=st.integers(1, 12))
    def evict_by_pressure(self, num):
        """Allocate a fresh sequence of ``num`` blocks of unique tokens, forcing evictions."""
        seq_id, self.next_id = self.next_id, self.next_id + 1
        if self.bm.allocate_slots(seq_id, num * BLOCK_SIZE):
            self.seqs[seq_id] = [100 + seq_id] * (num * BLOCK_SIZE)
            self._write(seq_id, self.seqs[seq_id], 0)

    @invariant()
    def conserved(self):
        self.bm.check_integrity()
        in_tables = {b for s in self.seqs for b in self.bm.block_tables[s]} - {NULL_BLOCK}
        assert len(in_tables) + self.bm.num_free_blocks == self.bm.num_blocks
        for seq_id, tokens in self.seqs.items():  # every live sequence reads back its own tokens
            table = self.bm.block_tables[seq_id]  # (those still in the window)
            kept = [p for p in range(len(tokens)) if table[p // BLOCK_SIZE] != NULL_BLOCK]
            first = max(0, len(tokens) - self.WINDOW + 1) if self.WINDOW else 0  # the next query's window
            window = range(first, len(tokens))
            assert all(table[p // BLOCK_SIZE] != NULL_BLOCK for p in window), "a block in the window was freed"
            assert [self.content[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in kept] == [tokens[p] for p in kept]


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class WindowedBlockManagerMachine(BlockManagerMachine):
    WINDOW = 6  # not a multiple of the block size: a block dies partway through the next one


TestWindowedBlockManagerMachine = WindowedBlockManagerMachine.TestCase
TestWindowedBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class _ModeledTiers(BlockManager):
    """The block manager, telling the machine below after each call that may queue tier moves (the
    executor applies them before anything else of the step: copies, swaps, writes)."""

    moved = staticmethod(lambda: None)

    def allocate_slots(self, *args, **kwargs):
        ok = super().allocate_slots(*args, **kwargs)
        self.moved()
        return ok

    def swap_in(self, seq_ids):
        pairs = super().swap_in(seq_ids)
        self.moved()
        return pairs


class TieredBlockManagerMachine(BlockManagerMachine):
    """With offload tiers: the executor's moves are modelled on the blocks' contents (host slots,
    files being written, files), reads and writes of files finish (or fail) in any order, and every
    prefix hit, from the device or brought back from the host tier, reads exactly its tokens."""

    @initialize(num_blocks=st.integers(4, 12), num_cpu_blocks=st.integers(0, 8), num_host=st.integers(1, 8),
                num_disk=st.integers(0, 6))
    def setup(self, num_blocks, num_cpu_blocks, num_host, num_disk):
        self.bm = _ModeledTiers(num_blocks, BLOCK_SIZE, watermark=0.0, num_cpu_blocks=num_cpu_blocks)
        self.bm.tiers = TierIndex(num_host, num_disk)
        self.bm.moved = self._apply_moves
        self.seqs, self.swapped, self.next_id, self.content, self.cpu_content = {}, {}, 0, {}, {}
        self.host: dict[int, list] = {}  # slot -> tokens
        self.writing: dict[bytes, list] = {}  # key -> tokens snapshotted for its file
        self.disk: dict[bytes, list] = {}  # key -> tokens in its file
        self.loads: list[tuple[bytes, int]] = []
        self.block_tokens: dict[bytes, list] = {}  # hash -> the tokens of its block
        self.prompts: list[list[int]] = []  # every prompt so far, to ask for again

    def _apply_moves(self):
        ops, keys = self.bm.tiers.take_ops()
        for kind, a, b in ops.tolist():
            if kind == TierOp.OFFLOAD:
                self.host[b] = list(self.content[a])
            elif kind == TierOp.RELOAD:
                self.content[b] = list(self.host[a])
            elif kind == TierOp.SPILL:
                self.writing[keys[b]] = list(self.host[a])
            elif kind == TierOp.LOAD:
                self.loads.append((keys[a], b))
            elif kind == TierOp.DELETE:
                self.disk.pop(keys[a], None)

    def _register(self, seq_id):
        tokens = self.seqs[seq_id]
        for i, h in enumerate(self.bm.prefix_hashes(tokens, len(tokens) // BLOCK_SIZE)):
            self.block_tokens[h] = tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
        super()._register(seq_id)

    @staticmethod
    def _sequence(seq_id, tokens):
        return Sequence(seq_id, "r", 0, list(tokens), SamplingParams(), frozenset(), 0.0)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def allocate_again(self, data):
        """An earlier prompt again: its blocks may be anywhere by now (device, host, file, gone)."""
        self.allocate(data.draw(st.sampled_from(self.prompts)))

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def load(self, data):
        """An earlier prompt waits for its blocks on disk: their reads are queued."""
        request_loads(self.bm, self._sequence(-1, data.draw(st.sampled_from(self.prompts))))
        self._apply_moves()

    @rule(tokens=TOKENS)
    def allocate(self, tokens):
        self.prompts.append(list(tokens))
        seq_id, self.next_id = self.next_id, self.next_id + 1
        seq = self._sequence(seq_id, tokens)
        hits = revive_host_hits(self.bm, seq, prefix_hits(self.bm, seq))
        self._apply_moves()
        for i, block_id in enumerate(hits):  # a hit, revived or not, holds exactly these tokens
            assert self.content[block_id] == tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
        if self.bm.allocate_slots(seq_id, len(tokens), len(hits) * BLOCK_SIZE, hits):
            self.seqs[seq_id] = list(tokens)
            self._write(seq_id, tokens, len(hits) * BLOCK_SIZE)
            self._register(seq_id)

    @rule(data=st.data(), ok=st.booleans())
    def finish_io(self, data, ok):
        """One file write or read ends (or fails: a full disk, a corrupt file)."""
        tiers = self.bm.tiers
        if self.loads and data.draw(st.booleans()):
            key, slot = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
            if ok:
                self.host[slot] = list(self.disk[key])
            tiers.on_loaded(key, ok)
        elif self.writing:
            key = data.draw(st.sampled_from(sorted(self.writing)))
            tokens = self.writing.pop(key)
            if ok:
                self.disk[key] = tokens
            tiers.on_stored(key, ok)

    @invariant()
    def tiers_hold_their_hashes(self):
        tiers = self.bm.tiers
        for h, slot in tiers.host.items():
            assert self.host[slot] == self.block_tokens[h], "a host slot holds another block's bytes"
        for h in tiers.stored:
            assert self.disk[h] == self.block_tokens[h], "a stored hash names another block's file"


TestTieredBlockManagerMachine = TieredBlockManagerMachine.TestCase
TestTieredBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
