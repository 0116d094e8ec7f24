"""Decode steps at a fixed set of batch sizes over static input buffers, captured in CUDA graphs on CUDA.

On a GPU, a decode step of a 135M-1B model is a few hundred small kernels, and launching them one by one
from Python, not reading the weights, is what bounds it. Captured once per batch size and replayed, a step
is one launch. Capture fixes every input's address and shape, so a step of n sequences runs at the
smallest captured size of at least n: its inputs are copied into static buffers, the padding rows write
their key and value to a scratch block and attend to it alone, and their logits are dropped. Attention
reads the paged cache in place through the block tables (`attention.PagedDecodeMask`), so no step copies
its context out of the cache. The "static" mode runs this same path without capturing it: how the CPU
tests cover everything but the capture itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pdserve.engine.attention import AttentionMetadata, PagedDecodeMask
from pdserve.engine.model import LlamaModel

MAX_CAPTURED_BATCH = 256  # above it a step's launches are a small share of its time; it runs eagerly


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to `max_batch` (capped): a step pads by at most 7 rows."""
    top = min(max_batch, MAX_CAPTURED_BATCH)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sizes if sizes[-1] == top else [*sizes, top]


@dataclass(frozen=True)
class DecodeBatch:
    """One decode token per sequence: its id, its position, the slot its key goes to, its block table."""

    token_ids: np.ndarray  # [n] int64
    positions: np.ndarray  # [n] int64
    slots: np.ndarray  # [n] int64
    block_tables: list[list[int]]  # each sequence's blocks, at least up to its position


class DecodeGraphs:
    """The decode step at each of `batch_sizes(max_batch)`, replayed from a CUDA graph when `capture`."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_batch: int,
        capture: bool,
    ) -> None:
        """`kv_caches`' last block is the scratch block: no sequence owns it, padding rows write to it."""
        self.sizes = batch_sizes(max_batch)
        self.captured = capture
        self.block_size = block_size
        device = kv_caches[0].device
        num_blocks = kv_caches[0].shape[1]
        self.scratch_block = num_blocks - 1
        rows = self.sizes[-1]
        width = min(num_blocks, -(-model.config.max_position_embeddings // block_size))  # the longest table
        # Token ids, positions and cache slots, then the block tables: two host-to-device copies per step.
        self._ints = torch.zeros(3, rows, dtype=torch.int64, device=device)
        self._tables = torch.full((rows, width), self.scratch_block, dtype=torch.int32, device=device)
        self._ints[2] = self.scratch_block * block_size
        self._mask = PagedDecodeMask(self._tables, self._ints[1], num_blocks, block_size)
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}
        self.steps_run = 0  # decode steps taken through here (the rest of a worker's steps ran eagerly)
        pool = torch.cuda.graph_pool_handle() if capture else None
        for size in reversed(self.sizes):  # the largest first: the smaller ones reuse its memory
            step = self._eager_step(model, kv_caches, size)
            self._steps[size] = _captured(step, pool, device) if capture else step

    def describe(self) -> str:
        """For a bench's or a log's header: how decode steps run."""
        how = "captured in CUDA graphs" if self.captured else "fixed-shape, not captured"
        return f"{how} at batch sizes {', '.join(map(str, self.sizes))}"

    def fits(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.sizes[-1]

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """float32 logits [n, vocab] for the batch's n sequences; valid until the next call."""
        n = len(batch.token_ids)
        size = next(s for s in self.sizes if s >= n)
        used = batch.positions // self.block_size + 1
        # Padding rows: token 0 at position 0, its key written to the scratch block's first slot.
        tables = np.full((size, used.max()), self.scratch_block, dtype=np.int32)
        counts = used.tolist()
        listed = chain.from_iterable(table[:c] for table, c in zip(batch.block_tables, counts, strict=True))
        # Row by row, so each row's blocks in order: one pass instead of a numpy call per row.
        tables[:n][np.arange(tables.shape[1]) < used[:, None]] = np.fromiter(listed, np.int32, int(used.sum()))
        ints = np.zeros((3, size), dtype=np.int64)
        ints[:, :n] = (batch.token_ids, batch.positions, batch.slots)
        ints[2, n:] = self.scratch_block * self.block_size
        self._ints[:, :size].copy_(torch.from_numpy(ints))
        self._tables[:size, : tables.shape[1]].copy_(torch.from_numpy(tables))
        self.steps_run += 1
        return self._steps[size]()[:n]

    def _eager_step(self, model: LlamaModel, kv_caches: list[torch.Tensor], size: int) -> Callable[[], torch.Tensor]:
        """The step at `size` rows, reading only the static buffers."""
        token_ids, positions, slots = self._ints[:, :size]
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode=size,
            decode_block_mask=self._mask.block_mask(size),
        )

        @torch.inference_mode()
        def step() -> torch.Tensor:
            self._mask.refresh(size)
            return model.compute_logits(model(token_ids, positions, kv_caches, meta))

        return step


def _captured(
    step: Callable[[], torch.Tensor], pool: torch.cuda._POOL_HANDLE | None, device: torch.device
) -> Callable[[], torch.Tensor]:
    """Runs `step` twice eagerly (compiling what it compiles, off the capture), then captures it once. On the
    model's own GPU: streams made on another (the current one, cuda:0 unless set) would capture nothing of its
    kernels, and the graph's replay would hand back the capture's logits every step."""
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            output = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay
