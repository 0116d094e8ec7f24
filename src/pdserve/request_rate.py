"""Requests per second, as loadgen's `--request-rate` sends them and `pdserve plan`, `pdserve bench placement` and
`pdserve chaos` take them: one range for all. Past 1e6 req/s the mean gap is under a microsecond, 50 times what one
loadgen process sends (measured, gRPC, two cores: 256 requests due at once went out in 13 ms, 20,000 req/s), so a
finite rate past it is sent as `inf` is, all at once, while a result, plot, plan or DistServe goodput (the highest
rate swept that met the SLOs) names a rate never offered (1e303 was taken)."""

from __future__ import annotations

import math

MAX_REQUEST_RATE = 1e6


def check_request_rate(rate: float, infinite: bool = True) -> float:
    """`rate`, or a ValueError saying the range and why it ends where it does; nan is out, and inf (all at once)
    is in where `infinite` (loadgen's), out where a rate must be simulated or drawn as gaps."""
    if not rate > 0 or (rate == math.inf and not infinite):
        raise ValueError(f"request rate must be {'> 0' if infinite else 'a finite number > 0'}, got {rate:g}")
    if MAX_REQUEST_RATE < rate < math.inf:
        raise ValueError(
            f"request rate must be at most {MAX_REQUEST_RATE:g} req/s{', or inf' if infinite else ''}, got {rate:g}: "
            f"past it, loadgen sends all at once whatever the rate says{', which inf names' if infinite else ''}"
        )
    return rate
