"""How fast a worker runs: measured at start-up, corrected from live steps, read by the router to predict.

Prefill time grows linearly in tokens plus a quadratic attention term; a decode step costs a fixed part
(reading the weights) plus a part per sequence in the batch. Both are least-squares fits of a few
measured points, so the same code describes a 2-core CPU and an H200.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

PREFILL_LENGTHS = (64, 256, 1024)  # the range prompts come in: extrapolating a quadratic misleads
DECODE_BATCHES = (1, 8, 32)


@dataclass(frozen=True)
class PerfProfile:
    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_per_token2_s: float
    decode_fixed_s: float
    decode_per_seq_s: float

    def prefill_s(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.prefill_fixed_s + self.prefill_per_token_s * tokens + self.prefill_per_token2_s * tokens**2

    def decode_step_s(self, batch: int) -> float:
        return self.decode_fixed_s + self.decode_per_seq_s * max(batch, 1)

    @classmethod
    def fit(cls, prefill: list[tuple[int, float]], decode: list[tuple[int, float]]) -> PerfProfile:
        n = np.array([p[0] for p in prefill], dtype=float)
        a = _nonneg_lstsq(np.stack([np.ones_like(n), n, n**2], axis=1), np.array([p[1] for p in prefill]))
        b_ = np.array([d[0] for d in decode], dtype=float)
        b = _nonneg_lstsq(np.stack([np.ones_like(b_), b_], axis=1), np.array([d[1] for d in decode]))
        return cls(float(a[0]), float(a[1]), float(a[2]), float(b[0]), float(b[1]))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PerfProfile:
        return cls(**{k: float(v) for k, v in d.items()})


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with negative coefficients dropped and the rest refitted: time never shrinks with work."""
    keep = np.ones(x.shape[1], dtype=bool)
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        keep &= coef > 0
        if not keep.any():
            return np.zeros(x.shape[1])


class SpeedTracker:
    """An exponentially weighted ratio of measured to predicted step time: the live correction."""

    def __init__(self, profile: PerfProfile, alpha: float = 0.1) -> None:
        self.profile = profile
        self.alpha = alpha
        self.factor = 1.0

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        predicted = self.profile.prefill_s(prefill_tokens) + (
            self.profile.decode_step_s(decode_seqs) if decode_seqs else 0.0
        )
        if predicted > 0:
            ratio = min(max(seconds / predicted, 0.25), 4.0)
            self.factor += self.alpha * (ratio - self.factor)


def measure_profile(engine: Any, repeats: int = 2) -> PerfProfile:
    """Times the model runner directly on scratch blocks; call before the worker takes requests."""
    from pdserve.engine.scheduler import ScheduledChunk

    runner, blocks = engine.runner, engine.blocks
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def timed(chunks: list[ScheduledChunk]) -> float:
        """The mean, not the best: admission must not promise what a busy worker only sometimes does."""
        runner.execute(chunks)  # kernels set up for this shape
        start = time.perf_counter()
        for _ in range(repeats):
            runner.execute(chunks)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats

    prefill = []
    for n in PREFILL_LENGTHS:
        if n >= engine.max_model_len or blocks.blocks_for(n) > blocks.num_blocks:
            continue
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        table = list(range(blocks.blocks_for(n)))
        prefill.append((n, timed([ScheduledChunk("profile", ids, 0, table, True)])))
    decode = []
    context = 64
    per_seq = blocks.blocks_for(context + 1)
    for batch in DECODE_BATCHES:
        if batch * per_seq > blocks.num_blocks or batch > engine.config.scheduler.max_num_seqs:
            continue
        chunks = [
            ScheduledChunk(f"p{i}", [1], context, list(range(i * per_seq, (i + 1) * per_seq)), True)
            for i in range(batch)
        ]
        decode.append((batch, timed(chunks)))
    return PerfProfile.fit(prefill, decode)
