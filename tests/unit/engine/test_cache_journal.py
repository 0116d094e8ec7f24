"""The journal's takes, applied in order, rebuild the prefix cache's keys exactly: what keeps a router's prefix
index from promising hits on evicted blocks."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import rule

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.cache_journal import PrefixCacheChanges, PrefixCacheJournal
from pdserve.protocol.prefix_hash import prefix_hashes
from tests.unit.engine.block_helpers import admit, make_seq
from tests.unit.engine.test_block_manager import BlockManagerMachine


def apply(index: set[bytes], changes: PrefixCacheChanges) -> set[bytes]:
    """What a prefix index does with a take."""
    kept = set() if changes.whole else index - set(changes.removed)
    return kept | set(changes.stored)


class JournalMachine(BlockManagerMachine):
    """The block manager's random workload, with a consumer that takes (or loses) the journal's changes."""

    def __init__(self) -> None:
        super().__init__()
        self.index: set[bytes] = set()

    @rule()
    def take(self) -> None:
        """Changes built up over any number of steps since the last take rebuild the cache, and count it."""
        changes = self._journal().take()
        self.index = apply(self.index, changes)
        assert self.index == set(self.bm.block_hashes())
        assert changes.held == len(self.index)

    @rule()
    def lose_a_take(self) -> None:
        self._journal().take()  # a write to Redis that failed: its changes never reach the index
        self._journal().lost()

    def teardown(self) -> None:
        self.take()
        super().teardown()

    def _journal(self) -> PrefixCacheJournal:
        assert self.bm.journal is not None
        return self.bm.journal


JournalMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_journal_state_machine = JournalMachine.TestCase


def test_evictions_past_the_bound_are_forgotten_and_the_next_take_is_the_whole_cache() -> None:
    bm = BlockManager(2, 2)
    assert bm.journal is not None
    assert bm.journal.take() == PrefixCacheChanges([], [], whole=True, held=0)  # the first take: the (empty) whole
    keys = []
    for i in range(6):  # each prompt of two blocks evicts the last one's: 10 evictions, past 4 per block
        seq = make_seq(f"s{i}", [i, i, i, i])
        admit(bm, seq)
        bm.free(seq)
        keys.append(prefix_hashes(seq.token_ids, 2))
    changes = bm.journal.take()
    assert changes.whole and set(changes.stored) == set(keys[-1]) == set(bm.block_hashes())
    assert bm.journal.take() == PrefixCacheChanges([], [], held=2)


def test_a_key_evicted_then_keyed_again_before_a_take_is_stored_not_removed() -> None:
    bm = BlockManager(1, 2)
    assert bm.journal is not None
    bm.journal.take()
    a, b, a_again = make_seq("a", [1, 1]), make_seq("b", [2, 2]), make_seq("a2", [1, 1])
    for seq in (a, b, a_again):
        admit(bm, seq)
        bm.free(seq)
    assert bm.journal.take() == PrefixCacheChanges(prefix_hashes([1, 1], 2), prefix_hashes([2, 2], 2), held=1)


def test_a_cache_without_prefix_caching_keeps_no_journal() -> None:
    assert BlockManager(4, 2, enable_prefix_caching=False).journal is None
