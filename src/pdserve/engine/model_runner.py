"""Turns a scheduled step into tensors, runs the model over the paged KV cache, returns logits."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.engine.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from pdserve.engine.decode_graphs import DecodeBatch, DecodeGraphs
from pdserve.engine.device import resolve_device, resolve_dtype
from pdserve.engine.host_heap import keep_large_allocations_in_heap
from pdserve.engine.model import LlamaModel
from pdserve.engine.model_files import read_model_config
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.weights import check_weights, load_folder_weights, read_gguf
from pdserve.protocol.model_config import ModelConfig
from pdserve.protocol.roles import EngineMode

logger = logging.getLogger(__name__)
# Padding a decode row may carry to share a call with longer rows: a few blocks cost less than a call of its own.
GROUP_SLACK_TOKENS = 256


@dataclass(frozen=True)
class StepLogits:
    """A step's float32 logits: the sampling chunks' last rows, and every row of the chunks that asked."""

    sampled: torch.Tensor  # [sampling chunks, vocab], in chunk order
    prompt: dict[str, torch.Tensor] = field(default_factory=dict)  # seq_id -> [chunk tokens, vocab]


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    """From a model folder or a .gguf file."""
    weights = read_gguf(path)[1] if path.suffix == ".gguf" else load_folder_weights(path)
    config = read_model_config(path)
    check_weights(config, weights, path)
    return LlamaModel(config, weights, dtype, device)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    per_layer = 2 * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize
    return per_layer * config.num_layers


class ModelRunner:
    def __init__(self, model: LlamaModel, engine_config: EngineConfig, num_blocks: int) -> None:
        self.model = model
        self.device = resolve_device(engine_config)
        if self.device.type == "cpu":
            keep_large_allocations_in_heap()
        self.dtype = resolve_dtype(engine_config)
        self.block_size = engine_config.block_size
        c = model.config
        # One block past the block manager's: the scratch block the decode graphs' padding rows write to.
        shape = (2, num_blocks + 1, self.block_size, c.num_kv_heads, c.head_dim)
        # Zeroed, not empty: padded gathers read unused blocks, and masked garbage could still be NaN.
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(c.num_layers)]
        self.decode_graphs = _decode_graphs(engine_config, self.device, model, self.kv_caches)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> StepLogits:
        """Runs every chunk; the logits of each sampling chunk's last token and of every token of a chunk
        marked `prompt_logits`."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(len(chunks)) and all(map(_is_decode, chunks)):
            return StepLogits(graphs.run(self._decode_batch(chunks)))
        input_ids, positions, meta, sample_rows = self._prepare(chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        prompt = {c.seq_id: self.model.compute_logits(hidden[rows]) for c, rows in _marked_rows(chunks)}
        if not sample_rows:
            return StepLogits(torch.empty(0, self.model.config.vocab_size, device=self.device), prompt)
        rows = torch.tensor(sample_rows, device=self.device)
        return StepLogits(self.model.compute_logits(hidden.index_select(0, rows)), prompt)

    def _prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        num_decode = sum(map(_continues_by_one, chunks))  # the scheduler puts them first
        decode = self._decode_batch(chunks[:num_decode])  # in plain Python: numpy costs more per token
        ids: list[int] = decode.token_ids.tolist()
        pos_parts, slot_parts = [decode.positions], [decode.slots]
        sample_rows = [row for row, chunk in enumerate(chunks[:num_decode]) if chunk.sample]
        for chunk in chunks[num_decode:]:
            n = len(chunk.token_ids)
            pos = np.arange(chunk.start_position, chunk.start_position + n)
            table = np.asarray(chunk.block_table, dtype=np.int64)
            ids.extend(chunk.token_ids)
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            if chunk.sample:
                sample_rows.append(len(ids) - 1)
        dev = self.device
        positions = np.concatenate(pos_parts)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(dev),
            num_decode=num_decode,
            decode_groups=self._decode_groups(chunks[:num_decode]),
            prefills=self._prefill_spans(chunks[num_decode:], start_row=num_decode),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        return input_ids, torch.from_numpy(positions).to(dev), meta, sample_rows

    def _decode_batch(self, chunks: list[ScheduledChunk]) -> DecodeBatch:
        bs = self.block_size
        positions = np.fromiter((c.start_position for c in chunks), dtype=np.int64, count=len(chunks))
        tables = [c.block_table for c in chunks]
        slots = np.fromiter(
            (table[p // bs] * bs + p % bs for table, p in zip(tables, positions.tolist(), strict=True)),
            dtype=np.int64,
            count=len(chunks),
        )
        token_ids = np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=len(chunks))
        return DecodeBatch(token_ids=token_ids, positions=positions, slots=slots, block_tables=tables)

    def _decode_groups(self, chunks: list[ScheduledChunk]) -> tuple[DecodeGroup, ...]:
        """The decode rows by context length, a row with those no more than twice (or `GROUP_SLACK_TOKENS`) longer
        than the group's shortest: on 2 CPU cores a 6000-token sequence among seven of 64 made its step cost as
        eight of 6000, each row padded to the longest (docs/experiments/decode_context/groups_bench.py: 2.2-2.9x).
        One group, the rows in order, where all are alike."""
        context_lens = np.array([c.start_position + 1 for c in chunks])
        order = np.argsort(context_lens, kind="stable")
        groups, start = [], 0
        for end in range(1, len(order) + 1):
            shortest = context_lens[order[start]]
            if end == len(order) or context_lens[order[end]] > max(2 * shortest, shortest + GROUP_SLACK_TOKENS):
                groups.append(order[start:end])
                start = end
        if len(groups) == 1:
            return (self._decode_group(chunks, context_lens, None),)
        return tuple(self._decode_group(chunks, context_lens, rows) for rows in groups)

    def _decode_group(
        self, chunks: list[ScheduledChunk], context_lens: np.ndarray, rows: np.ndarray | None
    ) -> DecodeGroup:
        picked = range(len(chunks)) if rows is None else rows.tolist()
        lens = context_lens[list(picked)]
        max_blocks = int(-(-lens.max() // self.block_size))
        tables = np.zeros((len(lens), max_blocks), dtype=np.int64)  # padding reads block 0, masked out
        for i, row in enumerate(picked):
            used = -(-int(lens[i]) // self.block_size)
            tables[i, :used] = chunks[row].block_table[:used]
        allowed = np.arange(max_blocks * self.block_size)[None, :] < lens[:, None]
        # Additive, in the model's dtype: SDPA would otherwise turn a boolean mask into this in every layer.
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(torch.from_numpy(~allowed), float("-inf"))
        dev = self.device
        return DecodeGroup(
            rows=None if rows is None else torch.from_numpy(rows.astype(np.int64)).to(dev),
            block_tables=torch.from_numpy(tables.reshape(-1)).to(dev),
            mask=mask[:, None, None, :].to(dev),
        )

    def _prefill_spans(self, chunks: list[ScheduledChunk], start_row: int) -> tuple[PrefillSpan, ...]:
        spans = []
        row = start_row
        for c in chunks:
            n = len(c.token_ids)
            if c.start_position == 0:
                spans.append(PrefillSpan(start=row, length=n, block_table=None, mask=None))
            else:
                context = c.start_position + n
                used = -(-context // self.block_size)
                table = torch.tensor(c.block_table[:used], dtype=torch.int64, device=self.device)
                q_pos = torch.arange(c.start_position, context, device=self.device)
                mask = torch.arange(context, device=self.device)[None, :] <= q_pos[:, None]
                spans.append(PrefillSpan(start=row, length=n, block_table=table, mask=mask))
            row += n
        return tuple(spans)


def _marked_rows(chunks: list[ScheduledChunk]) -> list[tuple[ScheduledChunk, slice]]:
    """The rows of the chunks marked `prompt_logits`, laid out as `_prepare` lays them: the one-token
    continuations first, one row each, then the other chunks' tokens in order."""
    if not any(c.prompt_logits for c in chunks):
        return []
    num_decode = sum(map(_continues_by_one, chunks))
    marked, row = [], num_decode
    for i, c in enumerate(chunks):
        if i < num_decode:
            rows = slice(i, i + 1)
        else:
            rows = slice(row, row + len(c.token_ids))
            row += len(c.token_ids)
        if c.prompt_logits:
            marked.append((c, rows))
    return marked


def _continues_by_one(chunk: ScheduledChunk) -> bool:
    """One token after tokens already in the cache: a decode, or a prompt's last token after a chunk."""
    return len(chunk.token_ids) == 1 and chunk.start_position > 0


def _is_decode(chunk: ScheduledChunk) -> bool:
    """One token past the cached ones whose logits pick the next: what a decode graph runs."""
    return _continues_by_one(chunk) and chunk.sample


def _decode_graphs(
    config: EngineConfig, device: torch.device, model: LlamaModel, kv_caches: list[torch.Tensor]
) -> DecodeGraphs | None:
    mode = config.decode_graphs
    if mode == "off" or (mode == "auto" and device.type != "cuda") or config.mode is EngineMode.PREFILL_ONLY:
        return None  # a prefill worker's every step runs a prompt
    max_batch = config.scheduler.max_num_seqs
    if mode == "static":
        return DecodeGraphs(model, kv_caches, config.block_size, max_batch, capture=False)
    try:
        return DecodeGraphs(model, kv_caches, config.block_size, max_batch, capture=True)
    except Exception:  # a speed-up, not a requirement: decoding eagerly still serves, at a cost the log names
        logger.warning("decode steps could not be captured in CUDA graphs; decoding eagerly", exc_info=True)
        return None
