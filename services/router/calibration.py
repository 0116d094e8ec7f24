"""The router's own correction of its TTFT predictions, per prefill worker, from the TTFTs it relays.

A worker's profile is measured once at start-up (often while its neighbours measure theirs) and corrected by
its own step times; what a client waits for also holds the hops, the hand-off and the scheduling around the
steps. The router sees every first token it predicted; from a request that ran alone on its prefill worker (its
TTFT is then its own cost, with no queue or batch-mates to blur it) it keeps the residual: a factor that
moves, in log space, a share of the way toward the factor that would have predicted each such TTFT. A first
token's fixed cost (fixed_cost.py) is learned from the same request first and taken off the TTFT: the factor
corrects what is left, of which it multiplies the compute.
"""

from __future__ import annotations

import math
from collections import defaultdict

MIN_FACTOR, MAX_FACTOR = 0.25, 4.0


class TTFTCalibration:
    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self._log_factor: defaultdict[str, float] = defaultdict(float)

    def factor(self, worker_id: str) -> float:
        return math.exp(self._log_factor[worker_id])

    def observe(self, worker_id: str, predicted_s: float, measured_s: float, factor_then: float) -> None:
        """`predicted_s`: what was predicted with the factor then, `factor_then`; the factor moves toward the one
        that would have predicted `measured_s`. Toward it, not by a step from the factor now: requests predicted
        with one factor that end later (overlapping decodes) would each add the whole correction again."""
        if predicted_s <= 0 or measured_s <= 0 or factor_then <= 0:
            return
        target = math.log(factor_then * measured_s / predicted_s)
        now = self._log_factor[worker_id]
        bounds = math.log(MIN_FACTOR), math.log(MAX_FACTOR)
        self._log_factor[worker_id] = min(max(now + self.alpha * (target - now), bounds[0]), bounds[1])

    def worker_ids(self) -> set[str]:
        return set(self._log_factor)

    def forget(self, worker_id: str) -> bool:
        self._log_factor.pop(worker_id, None)
        return True
