"""Small builders shared by the block manager tests."""

from __future__ import annotations

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from pdserve.protocol.sampling import SamplingParams

BS = 4


def make_seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams())


def check_counts(bm: BlockManager) -> None:
    assert bm.num_used_blocks + bm.num_free_blocks == bm.num_blocks
    assert 0 <= bm.num_cached_blocks <= bm.num_free_blocks
    assert 0 <= bm.num_used_blocks <= bm.num_blocks


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """What the scheduler does on admission: reuse the cached prefix, compute the rest in one chunk."""
    prefix = bm.match_prefix(seq)
    cached = len(prefix) * bm.block_size
    assert bm.allocate_slots(seq, seq.num_tokens - cached, prefix)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    check_counts(bm)
    return prefix
