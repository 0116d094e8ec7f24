"""Chained hashes of full KV blocks: the prefix-cache keys that routers and workers share."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence as Seq

import numpy as np


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
