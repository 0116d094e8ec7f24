"""Attention over the paged KV cache for a flattened batch of prefill chunks and decode tokens.

The batch is laid out decode tokens first (one query each), then each prefill chunk's tokens. Decode
queries attend in one batched call over keys gathered through their block tables; each prefill chunk
attends causally to its own new tokens and, when it continues an earlier chunk or a prefix-cache hit,
to the blocks already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence's chunk of new tokens, `start` rows into the flattened batch."""

    start: int
    length: int
    block_table: torch.Tensor | None  # [num_blocks] int64; None when the chunk has no earlier context
    mask: torch.Tensor | None  # [length, context_len] bool, True where attention is allowed


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset) of each token
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [num_decode * max_blocks] int64, flattened
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size]: 0 where allowed, else -inf
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
    if meta.num_decode:
        out[: meta.num_decode] = _decode_attention(q[: meta.num_decode], cache, meta)
    for span in meta.prefills:
        rows = slice(span.start, span.start + span.length)
        if span.block_table is None:
            out[rows] = _attend(q[rows], k[rows], v[rows], mask=None)
        else:
            kc, vc = _gather(cache, span.block_table)
            ctx = span.mask.shape[1]
            out[rows] = _attend(q[rows], kc[:ctx], vc[:ctx], mask=span.mask)
    return out


def _decode_attention(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The query heads sharing a KV head are folded into the query-length axis: one fused SDPA call over
    [B, kv_heads, group, d] needs neither a copy of K/V per query head nor the slow GQA path (~1.8x)."""
    num_decode, num_heads, head_dim = q.shape
    kc, vc = _gather(cache, meta.decode_block_tables)
    num_kv_heads = kc.shape[-2]
    kc = kc.view(num_decode, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, kv_heads, L, head_dim]
    vc = vc.view(num_decode, -1, num_kv_heads, head_dim).transpose(1, 2)
    grouped_q = q.view(num_decode, num_kv_heads, num_heads // num_kv_heads, head_dim)
    o = F.scaled_dot_product_attention(grouped_q, kc, vc, attn_mask=meta.decode_mask)
    return o.reshape(num_decode, num_heads, head_dim)


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
