"""A request's serving latency: what its first token waits for outside every engine thread (the router, its RPCs,
the hand-off's rendezvous, the relay), as the calibration measured it on an idle cluster.

It spreads from request to request (on the local cluster p10 to p90 was 5-15 ms in one run), so a single median
added to every request puts even the p90 TTFT of requests that never queue low. Where the profile keeps the
spread (`serving_latency_quantiles_s`), each request draws its own latency from it; the draws come from a fixed
seed, so the same trace and profile give the same prediction every time, and every rate `max_rate` tries, and
every shape, sees the same draws, whose differences then come from the rate and the shape alone.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

from pdserve.planner.hardware import HardwareProfile

QUANTILES = 20  # the calibration keeps the 19 cut points of 20 equal shares: the 5th, 10th, ..., 95th percentiles
SEED = 0


def spread(residuals: Sequence[float]) -> list[float]:
    """The quantiles the calibration keeps of its residuals (measured TTFT less the simulated one), each at least
    0 as their median is: a first token cannot come sooner than the engine threads make it."""
    return [max(0.0, q) for q in statistics.quantiles(residuals, n=QUANTILES, method="inclusive")]


def at(quantiles: Sequence[float], u: float) -> float:
    """The latency at probability `u` (0 to 1), by the inverse CDF: k cut points lie at 1/(k+1), ..., k/(k+1), the
    latency is linear between two, and the outermost one's beyond them."""
    x = min(max(u * (len(quantiles) + 1) - 1, 0.0), len(quantiles) - 1.0)
    i = int(x)
    return quantiles[i] if i == len(quantiles) - 1 else quantiles[i] + (x - i) * (quantiles[i + 1] - quantiles[i])


def serving_latencies(p: HardwareProfile, n: int) -> list[float]:
    """Each of `n` requests' serving latency, in order of arrival: drawn from the profile's spread, or its median
    where it keeps none."""
    if not p.serving_latency_quantiles_s:
        return [p.serving_latency_s] * n
    draw = random.Random(SEED)
    return [at(p.serving_latency_quantiles_s, draw.random()) for _ in range(n)]


def describe(p: HardwareProfile) -> str:
    """The median, and p10 to p90 where the profile keeps the spread: "8.6 ms (p10-p90 5-15 ms)"."""
    line = f"{p.serving_latency_s * 1e3:.1f} ms"
    if q := p.serving_latency_quantiles_s:
        line += f" (p10-p90 {at(q, 0.1) * 1e3:.0f}-{at(q, 0.9) * 1e3:.0f} ms)"
    return line
