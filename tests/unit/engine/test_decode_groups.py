"""Decode rows attend in groups of similar context (model_runner._decode_groups): a short row beside a long one
is not padded to the long one's width, and the step's logits are the same as in one padded call."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import model_runner
from pdserve.engine.scheduler import ScheduledChunk
from tests.unit.engine.engine_harness import make_engine

BLOCK = 4


def _decodes(contexts: list[int]) -> list[ScheduledChunk]:
    """One decode row per context, each over its own run of blocks (the cache's contents: whatever is there)."""
    chunks, first = [], 0
    for i, context in enumerate(contexts):
        blocks = -(-(context + 1) // BLOCK)
        chunks.append(ScheduledChunk(f"s{i}", [7 + i], context, list(range(first, first + blocks)), True))
        first += blocks
    return chunks


def test_a_long_row_among_short_ones_gets_a_call_of_its_own() -> None:
    runner = make_engine(num_kv_blocks=512, block_size=BLOCK).runner
    groups = runner._decode_groups(_decodes([40, 1200, 40, 50, 60]))
    widths = sorted(g.mask.shape[-1] for g in groups)
    assert len(groups) == 2 and widths[0] < 100 <= 1200 <= widths[1]
    rows = sorted(int(r) for g in groups for r in g.rows)
    assert rows == [0, 1, 2, 3, 4]  # each row in exactly one group
    (alike,) = runner._decode_groups(_decodes([40, 60, 100]))
    assert alike.rows is None  # one call, the rows in order: nothing to index


def test_grouped_decode_attention_gives_the_padded_calls_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(num_kv_blocks=512, block_size=BLOCK)
    gen = torch.Generator().manual_seed(0)
    for cache in engine.runner.kv_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    chunks = _decodes([40, 1200, 3, 50, 600])
    grouped = engine.runner.execute(chunks).sampled
    assert len(engine.runner._decode_groups(chunks)) > 1
    monkeypatch.setattr(model_runner, "GROUP_SLACK_TOKENS", 10**9)
    assert len(engine.runner._decode_groups(chunks)) == 1
    padded = engine.runner.execute(chunks).sampled
    torch.testing.assert_close(grouped, padded, rtol=1e-4, atol=1e-4)  # float32 sums in another order
