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

# A microsecond's mean gap, 50 times what one loadgen process sends (measured, gRPC, two cores: 256 requests due
# at once went out in 13 ms, 20,000 req/s): a finite rate past it is sent as `inf` is, while its result, plots and
# DistServe goodput (the highest rate swept that met the SLOs) name a rate never offered (1e303 was taken).
MAX_REQUEST_RATE = 1e6


def check_request_rate(rate: float) -> float:
    """`rate`, or a ValueError saying the range and why it ends where it does (nan is out; inf, all at once, in)."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate:g}")
    if MAX_REQUEST_RATE < rate < math.inf:
        raise ValueError(
            f"request rate must be at most {MAX_REQUEST_RATE:g} req/s, or inf, got {rate:g}: past it, loadgen "
            "sends all at once whatever the rate says, which inf names"
        )
    return rate


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
