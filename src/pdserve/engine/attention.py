"""Attention over the paged KV cache for a flattened batch of prefill chunks and decode tokens.

The batch is laid out decode tokens first (one query each), then each prefill chunk's tokens. Decode
queries attend in one batched call: either over keys gathered through their block tables, or (the
fixed-shape steps of `decode_graphs`) with flex attention reading the cache in place through a block mask
made of the tables. Each prefill chunk attends causally to its own new tokens and, when it continues an
earlier chunk or a prefix-cache hit, to the blocks already in the cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Flex attention's query tile: one decode query per row fits in it, and its decoding kernel needs a
# multiple of its 16-row tile. Keys are tiled by the cache's own block size, so a block-mask tile is a block.
_FLEX_Q_TILE = 128


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence's chunk of new tokens, `start` rows into the flattened batch."""

    start: int
    length: int
    block_table: torch.Tensor | None  # [num_blocks] int64; None when the chunk has no earlier context
    mask: torch.Tensor | None  # [length, context_len] bool, True where attention is allowed


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows of similar context, attended in one call over their gathered blocks: a row in a call with a far
    longer one would be padded to its width, and read (on a CPU, copy) that many blocks for nothing."""

    rows: torch.Tensor | None  # [n] int64: which of the batch's decode rows; None: all of them, in order
    block_tables: torch.Tensor  # [n * max_blocks] int64, flattened
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size]: 0 where allowed, else -inf


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset) of each token
    num_decode: int
    decode_groups: tuple[DecodeGroup, ...] = ()  # the gathering path's, covering every decode row once
    decode_block_mask: BlockMask | None = None  # set: decode attention reads the cache in place (flex)
    prefills: tuple[PrefillSpan, ...] = ()


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]."""
    num_kv_heads, head_dim = cache.shape[-2:]
    cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: the same tokens' new keys and values, already in `cache`."""
    out = torch.empty_like(q)
    if meta.decode_block_mask is not None:
        out[: meta.num_decode] = _paged_decode_attention(q[: meta.num_decode], cache, meta.decode_block_mask)
    else:
        decode_q = q[: meta.num_decode]
        for group in meta.decode_groups:
            if group.rows is None:
                out[: meta.num_decode] = _decode_attention(decode_q, cache, group)
            else:
                out.index_copy_(0, group.rows, _decode_attention(decode_q.index_select(0, group.rows), cache, group))
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.length)
        if span.block_table is None or span.mask is None:  # set together
            out[rows] = _attend(q[rows], k[rows], v[rows], mask=None)
        else:
            kc, vc = _gather(cache, span.block_table)
            ctx = span.mask.shape[1]
            out[rows] = _attend(q[rows], kc[:ctx], vc[:ctx], mask=span.mask)
    return out


def _decode_attention(q: torch.Tensor, cache: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
    """The query heads sharing a KV head are folded into the query-length axis: one fused SDPA call over
    [B, kv_heads, group, d] needs neither a copy of K/V per query head nor the slow GQA path (~1.8x)."""
    num_decode, num_heads, head_dim = q.shape
    kc, vc = _gather(cache, group.block_tables)
    num_kv_heads = kc.shape[-2]
    kc = kc.view(num_decode, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, kv_heads, L, head_dim]
    vc = vc.view(num_decode, -1, num_kv_heads, head_dim).transpose(1, 2)
    grouped_q = q.view(num_decode, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(grouped_q, kc, vc, attn_mask=group.mask)
    return o.reshape(num_decode, num_heads, head_dim)


class PagedDecodeMask:
    """Flex attention's block mask for up to `rows` decode queries, each over its own blocks of the cache.

    Flex attention sees the whole cache as one key sequence; a row's block table is its list of blocks to
    visit, and the mask function keeps the slots up to the row's position. Flex without compiling reads
    only that function, so it is exact on its own: it maps a cache slot to the row's logical position
    through `logical_block`, the inverse of the row's table (as vLLM's flex backend does). No block is
    passed as "full" (unmasked): flex's decoding kernel then splits a row's work by its table's length
    rather than by the whole cache's. Everything is derived on the device from `block_tables` and
    `positions` by `refresh`, so a step captured in a CUDA graph refreshes it from its static inputs.
    """

    def __init__(self, block_tables: torch.Tensor, positions: torch.Tensor, num_cache_blocks: int, block_size: int):
        """block_tables [rows, width] int32: each row's blocks in order, anything past its last used one;
        positions [rows] int64: the position of each row's query (its context is positions + 1 tokens)."""
        rows, width = block_tables.shape
        device = block_tables.device
        self.block_tables, self.positions, self.block_size = block_tables, positions, block_size
        self.num_cache_blocks = num_cache_blocks
        self._num_blocks = torch.ones(rows, 1, 1, dtype=torch.int32, device=device)
        self._logical_block = torch.zeros(rows, num_cache_blocks, dtype=torch.int32, device=device)
        self._columns = torch.arange(width, dtype=torch.int32, device=device).expand(rows, width)

    def block_mask(self, rows: int) -> BlockMask:
        """The mask of the first `rows` rows, over their slices of the buffers (built once, refreshed in place)."""
        logical_block, positions, block_size = self._logical_block[:rows], self.positions[:rows], self.block_size

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return logical_block[b, kv_idx // block_size] * block_size + kv_idx % block_size <= positions[b]

        width = self.block_tables.shape[1]
        return BlockMask.from_kv_blocks(
            self._num_blocks[:rows],
            self.block_tables[:rows].view(rows, 1, 1, width),
            BLOCK_SIZE=(_FLEX_Q_TILE, block_size),
            mask_mod=mask_mod,
            seq_lengths=(1, self.num_cache_blocks * block_size),
            compute_q_blocks=False,  # only the backward pass reads them
        )

    def refresh(self, rows: int) -> None:
        """Derives the first `rows` rows' mask tensors from their tables and positions, on the device."""
        tables, width = self.block_tables[:rows], self.block_tables.shape[1]
        used = torch.div(self.positions[:rows], self.block_size, rounding_mode="floor") + 1
        self._num_blocks[:rows].view(-1).copy_(used)
        # A block's first column in the row's table; `width` (past every position) where it is not listed.
        logical = self._logical_block[:rows]
        logical.fill_(width)
        logical.scatter_reduce_(1, tables.long(), self._columns[:rows], reduce="amin")


def _paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """q [B, heads, d] against the cache in place: keys and values are the cache's blocks viewed as one
    sequence [1, kv_heads, num_blocks * block_size, d], and the block mask names each row's blocks, so
    nothing is copied out of the cache. Compiled on CUDA (flex's decoding kernel); the eager reference
    elsewhere."""
    num_decode, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = cache.shape[1:4]
    keys = cache[0].view(1, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    values = cache[1].view(1, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    gqa = num_heads != num_kv_heads
    if q.is_cuda:
        o = _compiled_flex_attention()(q.unsqueeze(2), keys, values, block_mask=block_mask, enable_gqa=gqa)
    else:
        o = flex_attention(q.unsqueeze(2), keys, values, block_mask=block_mask, enable_gqa=gqa)
    return o.squeeze(2)


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """Compiled once per process, on first use: uncompiled, flex attention scores every key of the cache."""
    return torch.compile(flex_attention, fullgraph=True)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the listed blocks out of the cache: two [len(block_table) * block_size, kv_heads, head_dim]."""
    block_size, num_kv_heads, head_dim = cache.shape[2:]
    kc = cache[0].index_select(0, block_table).view(-1, num_kv_heads, head_dim)
    vc = cache[1].index_select(0, block_table).view(-1, num_kv_heads, head_dim)
    return kc, vc


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One sequence: q [n, heads, d], k/v [ctx, kv_heads, d]; causal from the first token when mask is None.

    K/V are repeated per query head, as transformers does: SDPA's own GQA path falls back to the
    unfused math kernel on CPU, and so do 3-D inputs, hence the batch axis of one."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
    )  # [1, heads, n, d]
    return o.squeeze(0).transpose(0, 1)
