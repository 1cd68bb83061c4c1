"""A hypothesis state machine over the block manager: conservation holds after every operation
(speculative decoding's rollback among them); and a windowed variant whose sequences also drop the blocks out of a sliding window."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.scheduler.block_manager import BlockManager
from services.scheduler.sliding_window import NULL_BLOCK

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
