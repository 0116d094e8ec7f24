"""One side's block ids and how a data message (layer, half) meets its cache: directly, or gathered / scattered."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Blocks:
    """Ids that form one run (a, a+1, ...) are sent from / received into the cache itself, with no copy.

    Scattered ids go through a contiguous byte buffer: on CPU with numpy (a single-threaded memcpy per block, GIL
    released; torch's index_copy_ is slow for bfloat16 and its OpenMP threads stall while gloo's I/O thread holds a
    core), on CUDA with index_select / index_copy_.
    """

    def __init__(self, ids: torch.Tensor, run_start: int | None) -> None:
        self.ids = ids
        self.n = ids.numel()
        self.run_start = run_start  # the ids are run_start, run_start + 1, ...
        if ids.device.type == "cpu":
            self.idx = ids.numpy()

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
        is_run = bool(id_list) and id_list == list(range(id_list[0], id_list[0] + len(id_list)))
        return cls(ids.to(kv.device), id_list[0] if is_run else None)

    def direct(self, kv: torch.Tensor, half: int) -> torch.Tensor | None:
        """The cache bytes of (layer, half) as one flat uint8 tensor, when the ids are a run."""
        if self.run_start is None:
            return None
        return kv[half, self.run_start : self.run_start + self.n].view(-1).view(torch.uint8)

    def gather(self, kv: torch.Tensor, half: int, out: torch.Tensor) -> None:
        """out (uint8) <- kv[half, ids]"""
        if kv.device.type == "cpu":
            rows = kv[half].view(torch.uint8).numpy().reshape(kv.shape[1], -1)
            np.take(rows, self.idx, axis=0, out=out.numpy().reshape(self.n, -1), mode="clip")
        else:
            torch.index_select(kv[half], 0, self.ids, out=out.view(kv.dtype).view(self.n, *kv.shape[2:]))

    def scatter(self, src: torch.Tensor, kv: torch.Tensor, half: int) -> None:
        """kv[half, ids] <- src (uint8)"""
        if kv.device.type == "cpu":
            kv[half].view(torch.uint8).numpy().reshape(kv.shape[1], -1)[self.idx] = src.numpy().reshape(self.n, -1)
        else:
            kv[half].index_copy_(0, self.ids, src.view(kv.dtype).view(self.n, *kv.shape[2:]))
