"""Chained hashes of full KV blocks: the prefix-cache keys that routers and workers share."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence as Seq

import numpy as np

INLINE_HASH_TOKENS = 16384  # a prompt's block hashes up to this many tokens (~1.4 ms) on the loop, past it a thread


def hash_block(parent: bytes, tokens: Seq[int]) -> bytes:
    """Stable across processes (unlike hash()), so routers and workers can share the keys."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def prefix_hashes(token_ids: Seq[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """The chained keys of every full block of `token_ids`. The chain starts from `salt`, so prompts under
    different salts (tenants) never share a key: neither a cache hit nor its timing crosses a salt."""
    hashes: list[bytes] = []
    parent = salt
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


async def prefix_hashes_off_loop(token_ids: Seq[int], block_size: int, salt: bytes = b"") -> list[bytes]:
    """`prefix_hashes` for a caller on an event loop, on a thread past INLINE_HASH_TOKENS: a 128k-token prompt's take
    ~11 ms, which every other stream on the loop would wait out."""
    if len(token_ids) <= INLINE_HASH_TOKENS:
        return prefix_hashes(token_ids, block_size, salt)
    return await asyncio.to_thread(prefix_hashes, token_ids, block_size, salt)
