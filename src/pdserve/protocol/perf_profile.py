"""How fast a worker runs, as routers read it: a fitted prefill curve and decode step line, and a KV hand-off's time.

A prompt's prefill costs a fixed part, a part per token, and causal attention's: the tokens before each new one,
(cached + new)² - cached² in all, whether it runs in one step or many. A decode step costs a fixed part (reading
the weights), a part per sequence in the batch, and a part per token of context its sequences attend over (long
prompts: a step at 8 x 6000 tokens of context took 25x one at 8 x 64 on a CPU). All are least-squares fits of
measured points, so the same code describes a 2-core CPU and an H200.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np


def attention_squares(new: int, cached: int = 0) -> int:
    """A prompt's causal attention, in the units of `PerfProfile.prefill_per_token2_s`: `new` tokens each attending to
    those before them, the `cached` ones (a prefix-cache hit, a chunked prompt's earlier chunks) included."""
    return (cached + new) ** 2 - cached**2


@dataclass(frozen=True)
class QueuedPrefill:
    """The prompt work a prefill worker has queued, as it reports it: enough for a router to price it (a prompt's
    prefill grows faster than its length, so the same tokens in fewer, longer prompts take longer)."""

    prompts: int = 0
    tokens: int = 0  # new tokens: past each prompt's cached prefix and what of it is computed
    # Each prompt's attention_squares summed: its new tokens' reads of the tokens before them, the cached ones too (a
    # prompt of n new tokens after c cached counts (c + n)² - c², so it may hold far more than its tokens squared).
    token_squares: int = 0

    def minus(self, other: QueuedPrefill) -> QueuedPrefill:
        """What is left of this queue once `other`'s prompts are out of it, as a queue could be: no tokens without
        a prompt, and squares at least those tokens' in that many equal prompts with nothing cached. No cap above:
        new tokens after a cached prefix hold far more than their count squared (that cap, from before their reads
        counted, cut another router's 512 tokens after 3584 cached to a fifteenth of their squares). `other` is an
        estimate, which may take more of one part than it took of another; its squares are what we predicted the
        worker counted for our prompts, so where its cache held less than we predicted (an eviction our prefix
        index learns of late), the rest is priced high until the next report, unless every prompt it held is one of
        `other`'s (an idle worker priced busy would shed what it could serve at once)."""
        tokens = self.tokens - other.tokens
        if tokens <= 0 or 0 < self.prompts <= other.prompts:
            return QueuedPrefill()
        prompts = max(1, self.prompts - other.prompts)
        squares = max(self.token_squares - other.token_squares, -(-(tokens * tokens) // prompts))
        return QueuedPrefill(prompts, tokens, squares)


@dataclass(frozen=True)
class PerfProfile:
    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_per_token2_s: float  # per unit of (cached + new)² - cached²: a new token's attention to those before it
    decode_fixed_s: float
    decode_per_seq_s: float
    # Per token of KV a decode step reads, the batch's sequences summed; 0: a worker of a build that did not
    # measure it (its step is priced by batch size alone, as then).
    decode_per_context_token_s: float = 0.0

    def prefill_s(self, tokens: int, cached: int = 0) -> float:
        """`tokens` new tokens of a prompt whose first `cached` tokens' KV is already there (a prefix-cache hit):
        each new token also attends to those."""
        if tokens <= 0:
            return 0.0
        attention = attention_squares(tokens, cached)
        return self.prefill_fixed_s + self.prefill_per_token_s * tokens + self.prefill_per_token2_s * attention

    def queued_prefill_s(self, queue: QueuedPrefill) -> float:
        """A queue of prompts priced as each prompt alone, as `prefill_s` prices one: `token_squares` carries the
        attention term, each prompt's reads of its cached prefix included, which a count of tokens alone would leave
        out."""
        return (
            self.prefill_fixed_s * queue.prompts
            + self.prefill_per_token_s * queue.tokens
            + self.prefill_per_token2_s * queue.token_squares
        )

    def decode_step_s(self, batch: int, context_tokens: int = 0) -> float:
        """`context_tokens`: the tokens the batch's sequences attend over, summed."""
        return (
            self.decode_fixed_s
            + self.decode_per_seq_s * max(batch, 1)
            + self.decode_per_context_token_s * max(context_tokens, 0)
        )

    @classmethod
    def fit(
        cls,
        prefill: list[tuple[int, int, float]],
        decode: list[tuple[int, int, float]],
    ) -> PerfProfile:
        """`prefill`: (new tokens, cached tokens before them, seconds) of one step each; `decode`: (batch, each
        sequence's context, seconds) points (fit_decode)."""
        new, cached, seconds = (np.array(column, dtype=float) for column in zip(*prefill, strict=True))
        attention = (cached + new) ** 2 - cached**2
        a = nonneg_lstsq(np.stack([np.ones_like(new), new, attention], axis=1), seconds)
        fixed, per_seq, per_context = fit_decode(decode)
        return cls(
            float(a[0]),
            float(a[1]),
            float(a[2]),
            fixed,
            per_seq,
            decode_per_context_token_s=per_context,
        )

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


def fit_decode(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """(batch, each sequence's context, s) points as fixed + per sequence x batch + per context token x batch x
    context: (decode_fixed_s, decode_per_seq_s, decode_per_context_token_s). One definition for a worker's start-up
    profile and `pdserve profile`. Points all at one context cannot tell a sequence's cost from its context's:
    the context term is then 0 (the batch line alone, as before the term)."""
    d = np.array(points, dtype=float).reshape(-1, 3)
    batch, context = d[:, 0], d[:, 1]
    columns = [np.ones_like(batch), batch] + ([batch * context] if len(set(context)) > 1 else [])
    coef = nonneg_lstsq(np.stack(columns, axis=1), d[:, 2])
    return float(coef[0]), float(coef[1]), float(coef[2]) if len(coef) > 2 else 0.0


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
