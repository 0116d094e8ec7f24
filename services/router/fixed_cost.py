"""The fixed part of a first token's time per prefill worker, learned apart from the compute's factor.

Whatever a prompt's length, its first token crosses the router, the decode worker's reservation and its call to the
prefill worker, the KV transfer's setup and the commit back: ~45 ms on the 2-core VM, around ~6 ms of compute for a
tiny-random prompt (docs/experiments/ttft_prediction/). calibration.py's factor multiplies the compute, so it cannot
reach a fixed cost several times the compute (its cap is 4), and where it can, it over-predicts long prompts to fit
short ones. From the same requests that ran alone, this fits TTFT = c + f * compute over the last `WINDOW` of them:
f is the Theil-Sen slope (the median of the pairs' slopes, which a few slow outliers move little where a least-squares
fit follows them), bounded as the factor is, so that what the factor cannot reach falls to c; c is the median of what
each request took besides f * compute, bounded to [0, MAX_FIXED_S]. Only c is kept: the factor, taught after it,
follows the worker's speed from one request to the next, where a window would lag. With no two sizes to tell them
apart, f takes its upper bound: c is then the least fixed cost the factor's cap leaves unexplained, and 0 wherever
the factor can explain the TTFT. 0 until `MIN_SAMPLES` requests taught it, as before.
"""

from __future__ import annotations

import statistics
from collections import deque

from services.router.calibration import MAX_FACTOR, MIN_FACTOR

WINDOW = 32  # requests alone per worker; its fit costs WINDOW**2 / 2 slopes (~0.3 ms) per request alone
MIN_SAMPLES = 8  # a first request's warm-up or a slow one alone cannot set it
MAX_FIXED_S = 0.5  # far above a data centre's hops; past it, the residual is the compute's


class FixedCost:
    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._samples: dict[str, deque[tuple[float, float]]] = {}
        self._fixed_s: dict[str, float] = {}

    def fixed_s(self, worker_id: str) -> float:
        return self._fixed_s.get(worker_id, 0.0)

    def observe(self, worker_id: str, compute_s: float, measured_s: float) -> float:
        """A request alone whose compute was predicted at `compute_s` (its profile at the worker's live speed, before
        the factor) and whose TTFT, less the prediction's other parts (KV transfer, decode step), was `measured_s`.
        Returns the worker's fixed cost now."""
        if compute_s < 0 or measured_s <= 0:
            return self.fixed_s(worker_id)
        samples = self._samples.setdefault(worker_id, deque(maxlen=self.window))
        samples.append((compute_s, measured_s))
        if len(samples) >= MIN_SAMPLES:
            slope = _slope(samples)
            fixed = statistics.median(measured - slope * compute for compute, measured in samples)
            self._fixed_s[worker_id] = min(max(fixed, 0.0), MAX_FIXED_S)
        return self.fixed_s(worker_id)

    def worker_ids(self) -> set[str]:
        return set(self._samples)

    def forget(self, worker_id: str) -> bool:
        self._samples.pop(worker_id, None)
        self._fixed_s.pop(worker_id, None)
        return True


def _slope(samples: deque[tuple[float, float]]) -> float:
    """The Theil-Sen slope of the (compute, measured) pairs, bounded to the factor's bounds; the upper bound without
    two different computes."""
    points = list(samples)
    slopes = [(y1 - y0) / (x1 - x0) for i, (x0, y0) in enumerate(points) for x1, y1 in points[i + 1 :] if x1 != x0]
    return min(max(statistics.median(slopes), MIN_FACTOR), MAX_FACTOR) if slopes else MAX_FACTOR
