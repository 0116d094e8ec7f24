"""When each request is sent: gamma-distributed gaps at a mean rate, as `vllm bench serve` draws them.

Burstiness is the gamma shape: 1 gives a Poisson process (exponential gaps); below 1 burstier, above 1
more regular. The mean gap stays 1 / rate whatever the shape. As vLLM does, each request's gap (the first's
too) is drawn and the arrivals are then scaled so that the last is at exactly n / rate: the offered rate is the
one asked for whatever the seed (unscaled, 100 arrivals at 10 req/s offered 7.9-13.0 req/s across seeds).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from loadgen.workload import Request
from pdserve.burstiness import check_burstiness
from pdserve.request_rate import check_request_rate


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Seconds from the start for `n` requests. An infinite rate sends all at once."""
    check_request_rate(rate)
    check_burstiness(burstiness)
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    offsets = np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n))
    return offsets * (n / rate / offsets[-1]) if offsets[-1] > 0 else offsets


def schedule(requests: list[Request], rate: float, burstiness: float, rng: np.random.Generator) -> list[Request]:
    offsets = arrival_offsets(len(requests), rate, burstiness, rng)
    return [replace(r, arrival_s=float(t)) for r, t in zip(requests, offsets, strict=True)]
