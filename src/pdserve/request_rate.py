"""Requests per second, as loadgen's `--request-rate` sends them and `pdserve plan`, `pdserve bench placement` and
`pdserve chaos` take them: one range for all. Past 1e6 req/s the mean gap is under a microsecond, 50 times what one
loadgen process sends (measured, gRPC, two cores: 256 requests due at once went out in 13 ms, 20,000 req/s), so a
finite rate past it is sent as `inf` is, all at once, while a result, plot, plan or DistServe goodput (the highest
rate swept that met the SLOs) names a rate never offered (1e303 was taken). Nor may the arrivals span more than
MAX_SPAN_S, at the slowest rate either takes: one bound, so a run loadgen sends is one plan can simulate."""

from __future__ import annotations

import math

MAX_REQUEST_RATE = 1e6
# Arrivals spread over at most ~32 years: past it the simulator's clock (float64 seconds) rounds latencies away
# (planner/workload.py says how far), and loadgen at 1e-12 req/s would wait ~1e12 s to send its second request.
MAX_SPAN_S = 1e9


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


def check_span(requests: int, rate: float, rate_flag: str, count_flag: str) -> None:
    """A ValueError where `requests` at `rate` (the last arrival at requests / rate, as both draw them) span more than
    MAX_SPAN_S, naming the two flags that set it."""
    if requests / rate > MAX_SPAN_S:
        raise ValueError(
            f"{rate_flag} {rate:g} spreads {requests} requests over {requests / rate:.3g} s, past the {MAX_SPAN_S:g} s "
            f"(~32 years) arrivals may span: raise {rate_flag} or lower {count_flag}"
        )
