"""Decode attention through flex attention's block mask (the decode graphs' path) equals the gathering path,
uncompiled and compiled: the compiled kernel visits only the blocks the tables list, the uncompiled one
reads only the mask function, so agreement in both shows the two halves of `PagedDecodeMask` agree."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from pdserve.engine.attention import AttentionMetadata, DecodeGroup, PagedDecodeMask, paged_attention

BLOCK_SIZE, NUM_BLOCKS, KV_HEADS, HEADS, HEAD_DIM = 16, 40, 2, 6, 16
# Context lengths: inside a block, exactly one block, several blocks ending mid-block and on a boundary, one token.
CONTEXTS = [5, 16, 17, 40, 48, 1]


def _case(width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random cache, queries, and block tables whose entries past the used ones are stale real blocks."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(len(CONTEXTS), HEADS, HEAD_DIM, generator=gen)
    tables = torch.randint(0, NUM_BLOCKS, (len(CONTEXTS), width), generator=gen, dtype=torch.int32)
    for row, context in enumerate(CONTEXTS):
        used = -(-context // BLOCK_SIZE)
        tables[row, :used] = torch.randperm(NUM_BLOCKS, generator=gen)[:used].int()
    return cache, q, tables, torch.tensor(CONTEXTS) - 1


def _gathered(cache: torch.Tensor, q: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The engine's other decode path: gather each row's blocks, mask past its context."""
    widest = -(-max(CONTEXTS) // BLOCK_SIZE)
    allowed = np.arange(widest * BLOCK_SIZE)[None, :] < np.array(CONTEXTS)[:, None]
    mask = torch.zeros(allowed.shape).masked_fill_(torch.from_numpy(~allowed), float("-inf"))[:, None, None, :]
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_decode=len(CONTEXTS),
        decode_groups=(DecodeGroup(None, tables[:, :widest].long().reshape(-1), mask),),
    )
    return paged_attention(q, q, q, cache, meta)


def _flex(
    q: torch.Tensor, cache: torch.Tensor, block_mask: BlockMask, attend: Callable[..., torch.Tensor] = flex_attention
) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's advice to compile, where a test checks the uncompiled path
        return attend(
            q.unsqueeze(2),
            cache[0].view(1, -1, KV_HEADS, HEAD_DIM).transpose(1, 2),
            cache[1].view(1, -1, KV_HEADS, HEAD_DIM).transpose(1, 2),
            block_mask=block_mask,
            enable_gqa=True,
        ).squeeze(2)


def test_the_engine_path_through_the_tables_equals_the_gathered_context() -> None:
    cache, q, tables, positions = _case(width=8)
    mask = PagedDecodeMask(tables, positions, NUM_BLOCKS, BLOCK_SIZE)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_decode=len(CONTEXTS),
        decode_block_mask=mask.block_mask(len(CONTEXTS)),
    )
    mask.refresh(len(CONTEXTS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = paged_attention(q, q, q, cache, meta)
    torch.testing.assert_close(ours, _gathered(cache, q, tables), rtol=1e-5, atol=1e-5)


def test_a_mask_built_before_its_buffers_are_filled_follows_them() -> None:
    """What a replayed graph relies on: the mask is built once, its buffers refilled and refreshed per step."""
    cache, q, tables, positions = _case(width=8)
    mask = PagedDecodeMask(torch.zeros_like(tables), torch.zeros_like(positions), NUM_BLOCKS, BLOCK_SIZE)
    block_mask = mask.block_mask(len(CONTEXTS))
    mask.block_tables.copy_(tables)
    mask.positions.copy_(positions)
    mask.refresh(len(CONTEXTS))
    torch.testing.assert_close(_flex(q, cache, block_mask), _gathered(cache, q, tables), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 4])
def test_the_first_rows_have_a_mask_of_their_own(rows: int) -> None:
    """Each captured batch size takes the first `rows` rows of shared buffers."""
    cache, q, tables, positions = _case(width=8)
    mask = PagedDecodeMask(tables, positions, NUM_BLOCKS, BLOCK_SIZE)
    block_mask = mask.block_mask(rows)
    mask.refresh(rows)
    expected = _gathered(cache, q, tables)[:rows]
    torch.testing.assert_close(_flex(q[:rows], cache, block_mask), expected, rtol=1e-5, atol=1e-5)


def test_compiled_flex_visits_only_the_listed_blocks() -> None:
    """Compiled, flex reads the block mask's tables and skips every other block, as its CUDA kernel does (the
    CPU kernel needs tables as wide as the cache)."""
    cache, q, tables, positions = _case(width=NUM_BLOCKS)
    mask = PagedDecodeMask(tables, positions, NUM_BLOCKS, BLOCK_SIZE)
    block_mask = mask.block_mask(len(CONTEXTS))
    mask.refresh(len(CONTEXTS))
    compiled = _flex(q, cache, block_mask, torch.compile(flex_attention, fullgraph=True))
    torch.testing.assert_close(compiled, _gathered(cache, q, tables), rtol=1e-5, atol=1e-5)
