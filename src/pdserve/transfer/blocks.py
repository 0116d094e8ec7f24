"""One side's block ids, and how a data message (layer, half, span of the ids) meets its cache: directly, or
gathered / scattered through a staging buffer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Blocks:
    """A span of ids that form one run (a, a+1, ...) is sent from / received into the cache itself, with no copy;
    the block manager hands out runs where it can, so most spans are. Other spans go through a contiguous byte
    buffer: on CPU with numpy (a single-threaded memcpy per block, GIL released; torch's index_copy_ is slow for
    bfloat16 and its OpenMP threads stall while gloo's I/O thread holds a core), on CUDA with index_select /
    index_copy_.
    """

    def __init__(self, ids: torch.Tensor, id_list: list[int]) -> None:
        self.ids = ids
        self.n = len(id_list)
        self.idx = np.asarray(id_list, dtype=np.int64)
        # breaks[i]: how many times the ids stop being consecutive up to position i; a span is a run iff its
        # first and last positions have the same count.
        self._breaks = np.concatenate(([0], np.cumsum(np.diff(self.idx) != 1))) if self.n else self.idx

    @classmethod
    def from_ids(cls, block_ids: Sequence[int], kv: torch.Tensor, distinct: bool) -> Blocks:
        """Checks the ids against `kv` (one layer's cache); a receiver needs them `distinct`, a sender does not."""
        id_list = [int(i) for i in block_ids]
        ids = torch.as_tensor(id_list, dtype=torch.int64)
        num_blocks = kv.shape[1]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            bad = [i for i in ids.tolist() if not 0 <= i < num_blocks][:8]
            raise ValueError(f"block ids must lie in [0, {num_blocks}), got {bad}")
        if distinct and torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"block ids must be distinct ({ids.numel()} ids, {torch.unique(ids).numel()} distinct)")
        return cls(ids.to(kv.device), id_list)

    def runs(self, max_runs: int) -> tuple[int, ...]:
        """The lengths of the ids' runs, in order; one span of all ids when there are more than `max_runs`."""
        if self.n == 0:
            return ()
        starts = np.flatnonzero(np.diff(self._breaks, prepend=-1))
        if len(starts) > max_runs:
            return (self.n,)
        return tuple(int(x) for x in np.diff(np.append(starts, self.n)))

    def direct(self, kv: torch.Tensor, half: int, start: int, length: int) -> torch.Tensor | None:
        """The cache bytes of (layer, half) for ids[start:start + length] as one flat uint8 tensor, when those ids
        are a run."""
        if self._breaks[start] != self._breaks[start + length - 1]:
            return None
        first = int(self.idx[start])
        return kv[half, first : first + length].view(-1).view(torch.uint8)

    def gather(self, kv: torch.Tensor, half: int, start: int, length: int, out: torch.Tensor) -> None:
        """out (uint8) <- kv[half, ids[start:start + length]]"""
        if kv.device.type == "cpu":
            rows = kv[half].view(torch.uint8).numpy().reshape(kv.shape[1], -1)
            np.take(rows, self.idx[start : start + length], axis=0, out=out.numpy().reshape(length, -1), mode="clip")
        else:
            ids = self.ids[start : start + length]
            torch.index_select(kv[half], 0, ids, out=out.view(kv.dtype).view(length, *kv.shape[2:]))

    def scatter(self, src: torch.Tensor, kv: torch.Tensor, half: int, start: int, length: int) -> None:
        """kv[half, ids[start:start + length]] <- src (uint8)"""
        if kv.device.type == "cpu":
            rows = kv[half].view(torch.uint8).numpy().reshape(kv.shape[1], -1)
            rows[self.idx[start : start + length]] = src.numpy().reshape(length, -1)
        else:
            kv[half].index_copy_(0, self.ids[start : start + length], src.view(kv.dtype).view(length, *kv.shape[2:]))
