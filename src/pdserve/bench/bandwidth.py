"""The memory-bandwidth bound of a decode step: no engine decodes faster than it can read the weights and the
batch's KV cache once per step. On a GPU a small model's decode step is bound by that, not by its GEMMs.

The device's bandwidth is measured here, as a large tensor copy (its bytes read plus written, over its time),
so the bound belongs to the machine the bench runs on rather than to a datasheet.
"""

from __future__ import annotations

import statistics
import time

import torch

from pdserve.engine.device import synchronize
from pdserve.engine.model import LlamaModel

COPY_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}  # large enough to leave every cache behind
COPY_REPEATS = 5


def copy_bandwidth_gbps(device: torch.device) -> float:
    """GB/s (1e9 bytes) a device-to-device copy moves, reads and writes counted."""
    size = COPY_BYTES.get(device.type, COPY_BYTES["cpu"])
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)

    def once() -> float:
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        return time.perf_counter() - start

    once()  # warm-up: first-touch page faults on CPU, lazy allocation on CUDA
    return 2 * size / statistics.median(once() for _ in range(COPY_REPEATS)) / 1e9


def weight_bytes_per_step(model: LlamaModel) -> int:
    """Every weight is read once per step but the embedding table, of which a step reads B rows. The LM head
    has its own parameter even when tied (a transposed copy on CPU), so it is counted once either way."""
    embed = model.embed_tokens
    return sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()


def decode_bound_tok_s(weight_bytes: int, kv_bytes_per_token: int, batch: int, context: float, gbps: float) -> float:
    """Tokens/s of `batch` sequences at an average `context` tokens if a step took only its reads."""
    step_bytes = weight_bytes + batch * context * kv_bytes_per_token
    return batch * gbps * 1e9 / step_bytes
