"""How fast a worker runs, as routers read it: a fitted prefill curve and decode step line, and a KV hand-off's time.

Prefill time grows linearly in tokens plus a quadratic attention term; a decode step costs a fixed part
(reading the weights) plus a part per sequence in the batch. Both are least-squares fits of a few
measured points, so the same code describes a 2-core CPU and an H200.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np


@dataclass(frozen=True)
class QueuedPrefill:
    """The prompt work a prefill worker has queued, as it reports it: enough for a router to price it (a prompt's
    prefill grows faster than its length, so the same tokens in fewer, longer prompts take longer)."""

    prompts: int = 0
    tokens: int = 0
    token_squares: int = 0  # each prompt's tokens, squared, summed

    def minus(self, other: QueuedPrefill) -> QueuedPrefill:
        """What is left of this queue once `other`'s prompts are out of it, as a queue could be: no tokens without
        a prompt, and squares between what those tokens in that many equal prompts and in one prompt would have
        (`other` is an estimate, which may take more of one part than it took of another)."""
        tokens = self.tokens - other.tokens
        if tokens <= 0:
            return QueuedPrefill()
        prompts = max(1, self.prompts - other.prompts)
        squares = min(max(self.token_squares - other.token_squares, -(-(tokens * tokens) // prompts)), tokens * tokens)
        return QueuedPrefill(prompts, tokens, squares)


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

    def queued_prefill_s(self, queue: QueuedPrefill) -> float:
        """A queue of prompts priced as each prompt alone, as `prefill_s` prices one: `token_squares` carries the
        quadratic term, which a count of tokens alone would leave out."""
        return (
            self.prefill_fixed_s * queue.prompts
            + self.prefill_per_token_s * queue.tokens
            + self.prefill_per_token2_s * queue.token_squares
        )

    def decode_step_s(self, batch: int) -> float:
        return self.decode_fixed_s + self.decode_per_seq_s * max(batch, 1)

    @classmethod
    def fit(cls, prefill: list[tuple[int, float]], decode: list[tuple[int, float]]) -> PerfProfile:
        n = np.array([p[0] for p in prefill], dtype=float)
        a = nonneg_lstsq(np.stack([np.ones_like(n), n, n**2], axis=1), np.array([p[1] for p in prefill]))
        b_ = np.array([d[0] for d in decode], dtype=float)
        b = nonneg_lstsq(np.stack([np.ones_like(b_), b_], axis=1), np.array([d[1] for d in decode]))
        return cls(float(a[0]), float(a[1]), float(a[2]), float(b[0]), float(b[1]))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PerfProfile:
        """Fields it does not know are ignored: a newer worker's registry entry must still parse on a router of an
        earlier build (else the router drops every upgraded worker as malformed)."""
        return cls(**{k: float(v) for k, v in d.items() if k in _PROFILE_FIELDS})


_PROFILE_FIELDS = frozenset(f.name for f in fields(PerfProfile))  # once: each worker's entry is parsed 4 times a second


def kv_transfer_s(tokens: int, kv_bytes_per_token: int, gbps: float, latency_s: float = 0.0) -> float:
    """A KV hand-off of `tokens` prompt tokens: `latency_s` (the hand-shake, the ack) plus its bytes at `gbps`, GB =
    1e9 bytes; 0 GB/s: bytes too cheap to measure. One definition for the router's prediction (its configured speed,
    no latency) and the planner's simulation (a profile's measured speed and latency), so both count it alike."""
    if gbps <= 0:
        return latency_s
    return latency_s + tokens * kv_bytes_per_token / (gbps * 1e9)


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
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
