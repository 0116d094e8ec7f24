"""What the planner simulates: request lengths and arrival times, from a trace or from a rate and lengths.

Arrivals are drawn once at unit rate and scaled to each rate the planner tries, so every rate sees the same
requests in the same order (common random numbers): attainment then falls with rate for the load alone,
not because one draw was luckier than the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.burstiness import check_burstiness
from pdserve.request_rate import check_request_rate, check_span
from pdserve.trace import read_trace

SYNTHETIC_REQUESTS = 400  # per run, unless told (a trace: every request, unless told)
# Arrivals span at most MAX_SPAN_S (request_rate.py). The simulator's clock is float64 seconds from the first
# arrival, and a request's latencies are differences of it: past this span they lose sub-millisecond precision (the
# max-rate search simulates down to 1/1024 of the rate, so its idle probe spans 1024 times as long). At 1e-12 req/s
# every TTFT read 31.25 ms, at 1e-15 req/s 0 ms, a plan that met any SLO.


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Workload:
    """Lengths and unit-rate arrival offsets; `at_rate` places them at any mean rate."""

    input_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    unit_offsets: tuple[float, ...]  # arrival times at a mean rate of 1 request/s
    rate: float  # the rate the trace or the flags name

    def at_rate(self, rate: float) -> list[SimRequest]:
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        return [
            SimRequest(t / rate, i, o)
            for t, i, o in zip(self.unit_offsets, self.input_lens, self.output_lens, strict=True)
        ]

    @property
    def mean_input_len(self) -> float:
        return float(np.mean(self.input_lens))

    @property
    def mean_output_len(self) -> float:
        return float(np.mean(self.output_lens))


def synthetic(
    rate: float,
    input_len: int,
    output_len: int,
    num_requests: int = SYNTHETIC_REQUESTS,
    range_ratio: float = 0.0,
    burstiness: float = 1.0,
    seed: int = 0,
) -> Workload:
    """As loadgen's random dataset: lengths uniform in len * [1 - r, 1 + r], gamma gaps (1 = Poisson) scaled, as
    loadgen and vLLM scale them, so that the last of n arrivals is at n / rate: the rate simulated is the one named
    whatever the seed (unscaled, seed 0's 400 arrivals at 10 req/s came at 8.9 req/s, and a plan's max rate
    overstated what the split sustains by as much)."""
    if rate <= 0 or num_requests < 1:
        raise ValueError("rate and num_requests must be > 0")
    check_span(num_requests, rate, "--rate", "--num-requests")
    check_burstiness(burstiness)
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def lengths(n: int) -> tuple[int, ...]:
        low, high = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return tuple(int(x) for x in rng.integers(low, high + 1, size=num_requests))

    inputs, outputs = lengths(input_len), lengths(output_len)
    offsets = np.cumsum(rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=num_requests))
    offsets *= num_requests / offsets[-1]
    return Workload(inputs, outputs, tuple(float(x) for x in offsets), rate)


def from_trace(path: Path, limit: int | None = None) -> Workload:
    """The first `limit` requests (None: all) of a Mooncake-format trace, read as loadgen replays it
    (pdserve.trace), at its gaps per second; its hash_ids are ignored (no prefix cache is simulated). A trace whose
    requests share one timestamp is refused: its arrivals scale to no other rate, so no split has a max rate to plan
    by (it was planned as "1 req/s", a rate it never offered); so is one whose rate no sender offers, or that spans
    more than the simulation's clock keeps to a millisecond (MAX_SPAN_S, which the reader checks)."""
    requests = read_trace(path, limit)
    times = np.array([r.timestamp_ms for r in requests]) / 1e3
    times -= times[0]
    span = float(times[-1])
    if not span > 0:
        raise ValueError(
            f"trace {path}: its {len(requests)} request(s) share one timestamp, a burst with no rate to scale; plan "
            "needs arrivals spread in time (or --rate, --input-len and --output-len)"
        )
    rate = (len(requests) - 1) / span
    try:  # a span of 1e-300 ms planned at 1e303 req/s
        check_request_rate(rate, infinite=False)
    except ValueError as e:
        raise ValueError(f"trace {path}: its gaps per second, {len(requests) - 1} over {span:g} s: {e}") from None
    return Workload(
        tuple(r.input_length for r in requests),
        tuple(r.output_length for r in requests),
        tuple(float(t) * rate for t in times),
        rate,
    )
