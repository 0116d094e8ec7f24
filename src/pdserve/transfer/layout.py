"""What both sides of a KV transfer must agree on before any byte moves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from pdserve.transfer.base import LayoutMismatchError


@dataclass(frozen=True)
class KVLayout:
    """Mirrors the `KVLayout` protobuf message; `dtype` is torch's name without the prefix ("bfloat16")."""

    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_caches(cls, kv_caches: Sequence[torch.Tensor], fingerprint: str) -> KVLayout:
        """From the engine's caches: one tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        first = kv_caches[0]
        if first.dim() != 5 or first.shape[0] != 2:
            raise ValueError(f"a layer's cache must be [2, blocks, block_size, kv_heads, head_dim], got {first.shape}")
        for i, kv in enumerate(kv_caches):
            if kv.shape != first.shape or kv.dtype != first.dtype or kv.device != first.device:
                raise ValueError(f"layer {i} cache is {kv.shape} {kv.dtype} on {kv.device}; layer 0 differs")
            if not kv.is_contiguous():
                raise ValueError(f"layer {i} cache is not contiguous")
        _, _, block_size, num_kv_heads, head_dim = first.shape
        return cls(
            model_fingerprint=fingerprint,
            dtype=str(first.dtype).removeprefix("torch."),
            block_size=block_size,
            num_layers=len(kv_caches),
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        return dtype

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block in one layer, keys and values."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    def bytes_for(self, num_blocks: int) -> int:
        """Bytes a transfer of `num_blocks` blocks moves, all layers."""
        return self.num_layers * num_blocks * self.layer_block_bytes

    def mismatches(self, other: KVLayout) -> list[str]:
        """Names of the fields that differ, in declaration order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def check_compatible(self, other: KVLayout) -> None:
        """Raises LayoutMismatchError naming every differing field (this side's value first)."""
        diffs = self.mismatches(other)
        if diffs:
            detail = ", ".join(f"{n} {getattr(self, n)!r} here vs {getattr(other, n)!r} on the peer" for n in diffs)
            raise LayoutMismatchError(f"KV layout mismatch: {detail}")
