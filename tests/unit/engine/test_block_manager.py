from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from pdserve.protocol.prefix_hash import prefix_hashes
from tests.unit.engine.block_helpers import BS, admit, check_counts, make_seq


def _drain(bm: BlockManager, seq_id: str = "drain") -> Sequence:
    """Take every block an allocation can get (evicting all cached ones)."""
    seq = make_seq(seq_id, [7] * (bm.num_free_blocks * bm.block_size))
    assert bm.allocate_slots(seq, seq.num_tokens)
    assert bm.num_free_blocks == 0
    return seq


def test_rejects_an_empty_pool() -> None:
    with pytest.raises(ValueError):
        BlockManager(0, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_allocate_append_free() -> None:
    bm = BlockManager(8, BS)
    seq = make_seq("a", list(range(10)))
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert bm.num_used_blocks == 3
    check_counts(bm)

    seq.num_computed_tokens = 10
    seq.output_token_ids += [100, 101]  # 12 tokens still fit in 3 blocks
    assert bm.allocate_slots(seq, 2)
    assert len(seq.block_table) == 3
    seq.num_computed_tokens = 12
    seq.output_token_ids.append(102)  # the 13th token needs a 4th block
    first_three = list(seq.block_table)
    assert bm.allocate_slots(seq, 1)
    assert seq.block_table[:3] == first_three
    assert len(set(seq.block_table)) == 4
    assert bm.num_used_blocks == 4
    check_counts(bm)

    bm.free(seq)
    assert seq.block_table == []
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks == 8
    check_counts(bm)


def test_zero_new_tokens_allocates_nothing() -> None:
    bm = BlockManager(4, BS)
    seq = make_seq("a", [1, 2, 3, 4])
    assert bm.allocate_slots(seq, 4)
    seq.num_computed_tokens = 4
    assert bm.allocate_slots(seq, 0)
    assert len(seq.block_table) == 1


def test_shared_prefix_blocks_are_reference_counted() -> None:
    bm = BlockManager(16, BS)
    prefix = list(range(50, 62))  # 3 full blocks
    a = make_seq("a", prefix + [1, 2])
    b = make_seq("b", prefix + [3, 4, 5])
    assert admit(bm, a) == []
    shared = admit(bm, b)
    assert shared == a.block_table[:3]
    assert b.block_table[:3] == a.block_table[:3]
    assert set(b.block_table[3:]).isdisjoint(a.block_table)
    assert bm.num_used_blocks == 4 + 1  # a: 3 shared + 1 tail, b: 1 tail

    a_tail = a.block_table[3:]
    bm.free(a)
    assert bm.num_used_blocks == 4  # b still holds the shared ones
    check_counts(bm)
    # Nothing b holds can be handed to anyone else, even when the pool is drained.
    drain = _drain(bm)
    assert set(drain.block_table).isdisjoint(b.block_table)
    assert set(a_tail) <= set(drain.block_table)
    bm.free(drain)
    bm.free(b)
    assert bm.num_used_blocks == 0
    check_counts(bm)


def test_prefix_blocks_are_reused_after_the_first_request_finishes() -> None:
    bm = BlockManager(16, BS)
    prefix = list(range(30, 42))
    a = make_seq("a", prefix + [1, 2])
    admit(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_used_blocks == 0
    assert bm.num_cached_blocks == 3  # the partial tail block is not cached
    assert set(bm.block_hashes()) == set(prefix_hashes(a.token_ids, BS))

    c = make_seq("c", prefix + [9, 9, 9, 9, 9])
    assert bm.match_prefix(c) == a_blocks[:3]
    hits = bm.prefix_hits
    admit(bm, c)
    assert bm.prefix_hits == hits + 3
    assert c.block_table[:3] == a_blocks[:3]
    assert bm.num_cached_blocks == 0  # revived: held again
    assert bm.num_used_blocks == 5

    # A partial match stops at the first block that differs, even if later blocks coincide.
    d = make_seq("d", prefix[:4] + [0, 0, 0, 0] + prefix[8:] + [1])
    assert bm.match_prefix(d) == a_blocks[:1]


def test_different_block_contents_do_not_match() -> None:
    bm = BlockManager(16, BS)
    admit(bm, make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert bm.match_prefix(make_seq("b", [1, 2, 3, 5, 5, 6, 7, 8, 9])) == []
    # Same second block after a different first block: chained keys must not match it.
    assert bm.match_prefix(make_seq("c", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


@pytest.mark.parametrize("num_blocks_in_prompt", [1, 2, 3])
def test_at_least_one_token_is_left_to_compute(num_blocks_in_prompt: int) -> None:
    bm = BlockManager(16, BS)
    tokens = list(range(100, 100 + num_blocks_in_prompt * BS))
    a = make_seq("a", tokens)
    admit(bm, a)
    bm.free(a)
    again = make_seq("again", tokens)
    prefix = bm.match_prefix(again)
    assert len(prefix) * BS < again.num_tokens
    assert len(prefix) == num_blocks_in_prompt - 1
    # One token more and the whole original prompt is reusable.
    longer = make_seq("longer", tokens + [5])
    assert len(bm.match_prefix(longer)) == num_blocks_in_prompt


def test_prefix_caching_disabled_never_matches() -> None:
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = make_seq("a", list(range(20)))
    admit(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 0
    assert bm.block_hashes() == []
    assert bm.match_prefix(make_seq("b", list(range(20)))) == []


def test_lru_eviction_takes_the_least_recently_used_cached_blocks_first() -> None:
    bm = BlockManager(5, 2)
    a, b = make_seq("a", [1, 2, 3, 4]), make_seq("b", [5, 6, 7, 8])
    admit(bm, a)
    bm.free(a)
    admit(bm, b)
    bm.free(b)
    a_keys, b_keys = prefix_hashes(a.token_ids, 2), prefix_hashes(b.token_ids, 2)
    assert bm.num_cached_blocks == 4 and bm.num_used_blocks == 0

    # Reusing a (2 cached blocks + the one never-cached block) makes it the most recently used.
    a2 = make_seq("a2", [1, 2, 3, 4, 0])
    assert len(admit(bm, a2)) == 2
    assert bm.num_free_blocks == 2  # b's blocks, still cached
    bm.free(a2)
    assert set(bm.block_hashes()) == set(a_keys) | set(b_keys)

    c = make_seq("c", [9, 9, 9, 9])  # the free block, then b's tail (tails are freed before heads)
    assert bm.allocate_slots(c, 4)
    assert b_keys[1] not in bm.block_hashes()
    assert b_keys[0] in bm.block_hashes()
    assert set(a_keys) <= set(bm.block_hashes())
    assert len(bm.match_prefix(make_seq("b3", [5, 6, 7, 8, 0]))) == 1
    check_counts(bm)

    d = make_seq("d", [8, 8])
    assert bm.allocate_slots(d, 2)  # then b's head, before anything of a
    assert not set(b_keys) & set(bm.block_hashes())
    assert set(a_keys) == set(bm.block_hashes())
    assert bm.match_prefix(make_seq("b4", [5, 6, 7, 8, 0])) == []
    assert len(bm.match_prefix(make_seq("a3", [1, 2, 3, 4, 0]))) == 2
    check_counts(bm)

    e = make_seq("e", [7, 7])
    assert bm.allocate_slots(e, 2)  # only a is left to evict: its tail goes first
    assert set(bm.block_hashes()) == {a_keys[0]}
    assert bm.num_free_blocks == 1 and bm.num_cached_blocks == 1


def test_free_blocks_are_used_before_cached_ones() -> None:
    bm = BlockManager(6, 2)
    a = make_seq("a", [1, 2, 3, 4])
    admit(bm, a)
    bm.free(a)
    b = make_seq("b", [9] * 8)  # exactly the 4 never-cached blocks
    assert bm.allocate_slots(b, 8)
    assert bm.num_cached_blocks == 2
    assert len(bm.match_prefix(make_seq("a2", [1, 2, 3, 4, 5]))) == 2


def test_a_chunk_of_a_long_prompt_leaves_the_cache_alone_while_free_blocks_hold_the_prompt() -> None:
    """A first chunk takes its blocks where the whole prompt will fit; it evicts nothing when free blocks hold
    all of it (it evicted cached prefixes up to the rest of the prompt, every chunk of every long prompt)."""
    bm = BlockManager(200, BS)
    cached = make_seq("cached", list(range(40)))
    admit(bm, cached)
    bm.free(cached)
    assert bm.num_cached_blocks == 10
    long_prompt = make_seq("long", list(range(1000, 1400)))  # 100 blocks, computed 8 at a time
    assert bm.allocate_slots(long_prompt, 32)
    assert bm.num_cached_blocks == 10
    assert len(bm.match_prefix(make_seq("again", list(range(41))))) == 10
    long_prompt.num_computed_tokens = 32
    assert bm.allocate_slots(long_prompt, 32)
    assert long_prompt.block_table == list(range(long_prompt.block_table[0], long_prompt.block_table[0] + 16))
    check_counts(bm)


def test_allocate_slots_is_all_or_nothing() -> None:
    bm = BlockManager(4, BS)
    a = make_seq("a", list(range(12)))
    assert bm.allocate_slots(a, 12)
    b = make_seq("b", list(range(50, 58)))
    before = (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks, bm.prefix_hits)
    assert not bm.allocate_slots(b, 8)
    assert b.block_table == []
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.num_cached_blocks, bm.prefix_hits) == before

    # A growing sequence that does not fit keeps its table as it was.
    a.num_computed_tokens = 12
    table = list(a.block_table)
    assert not bm.allocate_slots(a, 9)  # 21 tokens: 6 blocks, only 1 more free
    assert a.block_table == table
    assert bm.allocate_slots(a, 4)
    assert bm.num_free_blocks == 0


def test_failed_allocation_with_a_cached_prefix_leaves_the_cache_alone() -> None:
    bm = BlockManager(4, BS)
    a = make_seq("a", list(range(9)))  # 2 full blocks + 1
    admit(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 2
    holder = make_seq("holder", [0] * 8)
    assert bm.allocate_slots(holder, 8)  # takes the 2 uncached blocks
    b = make_seq("b", list(range(8)) + [1] * 6)  # 2 prefix blocks + 6 tokens: needs 2 more, none free
    prefix = bm.match_prefix(b)
    assert len(prefix) == 2
    hits = bm.prefix_hits
    assert not bm.allocate_slots(b, 6, prefix)
    assert b.block_table == []
    assert bm.prefix_hits == hits
    assert bm.num_cached_blocks == 2
    assert bm.match_prefix(b) == prefix
    # Even one token past the prefix does not fit: reviving the prefix alone uses up the pool.
    assert not bm.allocate_slots(b, 1, prefix)
    bm.free(holder)
    assert bm.allocate_slots(b, 6, prefix)
    assert b.block_table[:2] == prefix
    check_counts(bm)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit/grow/free of sequences that share prefixes, with a model of what each block holds."""

    PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 9, 9, 9, 9], [5] * 12, [])

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(8, BS)
        self.live: list[Sequence] = []
        self.finished_tokens: list[list[int]] = []
        self.content: dict[int, list[int | None]] = {}  # block -> token written in each slot
        self.expected_hits = 0
        self.counter = 0

    def _compute(self, seq: Sequence, n: int) -> None:
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = seq.block_table[pos // BS]
            self.content.setdefault(block, [None] * BS)[pos % BS] = seq.token_ids[pos]
        seq.num_computed_tokens += n
        self.bm.cache_full_blocks(seq)

    @rule(
        which=st.integers(0, len(PREFIXES) - 1),
        tail=st.lists(st.integers(0, 20), max_size=10),
        reuse=st.booleans(),
        frac=st.floats(0, 1),
    )
    def admit(self, which: int, tail: list[int], reuse: bool, frac: float) -> None:
        if reuse and self.finished_tokens:
            tokens = self.finished_tokens[len(tail) % len(self.finished_tokens)]
        else:
            tokens = self.PREFIXES[which] + tail
        if not tokens:
            return
        self.counter += 1
        seq = make_seq(f"s{self.counter}", tokens)
        prefix = self.bm.match_prefix(seq)
        cached = len(prefix) * BS
        assert cached < seq.num_tokens
        # A matched block really holds this sequence's tokens.
        for i, block in enumerate(prefix):
            assert self.content[block] == seq.token_ids[i * BS : (i + 1) * BS]
        n = max(1, round(frac * (seq.num_tokens - cached)))
        free_before = self.bm.num_free_blocks
        if self.bm.allocate_slots(seq, n, prefix):
            self.expected_hits += len(prefix)
            seq.num_computed_tokens = cached
            self._compute(seq, n)
            self.live.append(seq)
        else:
            assert seq.block_table == []
            assert self.bm.num_free_blocks == free_before

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6), n=st.integers(1, 6), token=st.integers(0, 20))
    def grow(self, i: int, n: int, token: int) -> None:
        seq = self.live[i % len(self.live)]
        if seq.num_uncomputed_tokens == 0:
            seq.output_token_ids.append(token)  # a sampled token
        n = min(n, seq.num_uncomputed_tokens)
        table = list(seq.block_table)
        if self.bm.allocate_slots(seq, n):
            assert seq.block_table[: len(table)] == table
            self._compute(seq, n)
        else:
            assert seq.block_table == table

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6))
    def free(self, i: int) -> None:
        seq = self.live.pop(i % len(self.live))
        if seq.num_computed_tokens == seq.num_tokens:
            self.finished_tokens.append(seq.token_ids)
        self.bm.free(seq)
        assert seq.block_table == []

    @invariant()
    def counts_add_up(self) -> None:
        check_counts(self.bm)
        assert self.bm.prefix_hits == self.expected_hits
        held = {b for s in self.live for b in s.block_table}
        assert self.bm.num_used_blocks == len(held)

    @invariant()
    def blocks_are_shared_only_by_equal_prefixes(self) -> None:
        owner: dict[int, tuple[Sequence, int]] = {}
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table)
            assert len(seq.block_table) * BS >= seq.num_computed_tokens
            keys = prefix_hashes(seq.token_ids, BS)
            for i, block in enumerate(seq.block_table):
                if block in owner:
                    other, j = owner[block]
                    assert i == j, f"block {block} at different positions in {other.seq_id} and {seq.seq_id}"
                    other_keys = prefix_hashes(other.token_ids, BS)
                    assert i < len(keys) and i < len(other_keys)
                    assert keys[i] == other_keys[i]
                else:
                    owner[block] = (seq, i)

    @invariant()
    def computed_tokens_are_still_in_their_blocks(self) -> None:
        for seq in self.live:
            for pos in range(seq.num_computed_tokens):
                block = seq.block_table[pos // BS]
                assert self.content[block][pos % BS] == seq.token_ids[pos]

    def teardown(self) -> None:
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_used_blocks == 0
        assert self.bm.num_free_blocks == self.bm.num_blocks
        check_counts(self.bm)


BlockManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
