"""What the planner simulates: request lengths and arrival times, from a trace or from a rate and lengths.

Arrivals are drawn once at unit rate and scaled to each rate the planner tries, so every rate sees the same
requests in the same order (common random numbers): attainment then falls with rate for the load alone,
not because one draw was luckier than the next.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


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
    num_requests: int = 400,
    range_ratio: float = 0.0,
    burstiness: float = 1.0,
    seed: int = 0,
) -> Workload:
    """As loadgen's random dataset: lengths uniform in len * [1 - r, 1 + r], gamma gaps (1 = Poisson) scaled, as
    loadgen and vLLM scale them, so that the last of n arrivals is at n / rate: the rate simulated is the one named
    whatever the seed (unscaled, seed 0's 400 arrivals at 10 req/s came at 8.9 req/s, and a plan's max rate
    overstated what the split sustains by as much)."""
    if rate <= 0 or burstiness <= 0 or num_requests < 1:
        raise ValueError("rate, burstiness and num_requests must be > 0")
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


def from_trace(path: Path) -> Workload:
    """Mooncake-format JSONL (timestamp in ms, input_length, output_length), as loadgen replays it, at its gaps per
    second. A trace whose requests share one timestamp is refused: its arrivals scale to no other rate, so no
    split has a max rate to plan by (it was planned as "1 req/s", a rate it never offered)."""
    rows = [_trace_row(path, n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not rows:
        raise ValueError(f"trace {path} holds no requests")
    rows.sort(key=lambda row: row[0])
    times = np.array([t for t, _, _ in rows]) / 1e3
    times -= times[0]
    span = float(times[-1])
    if not span > 0:
        raise ValueError(
            f"trace {path}: its {len(rows)} request(s) share one timestamp, a burst with no rate to scale; plan "
            "needs arrivals spread in time (or --rate, --input-len and --output-len)"
        )
    rate = (len(rows) - 1) / span
    return Workload(
        tuple(i for _, i, _ in rows),
        tuple(o for _, _, o in rows),
        tuple(float(t) * rate for t in times),
        rate,
    )


def _trace_row(path: Path, n: int, line: str) -> tuple[float, int, int]:
    """Line `n`'s (timestamp ms, input_length, output_length); a ValueError that names the line and what it lacks,
    which `pdserve plan` reports as a usage error."""
    try:
        row = json.loads(line)
        at, lengths = float(row["timestamp"]), (int(row["input_length"]), int(row["output_length"]))
    except KeyError as e:
        raise ValueError(f"trace {path} line {n}: no {e.args[0]!r}") from None
    except (ValueError, TypeError, OverflowError) as e:  # OverflowError: a length of 1e999
        raise ValueError(f"trace {path} line {n}: {e}") from None
    if not math.isfinite(at):
        raise ValueError(f"trace {path} line {n}: timestamp {at} is not a time")
    if min(lengths) < 1:
        raise ValueError(f"trace {path} line {n}: input_length and output_length must be at least 1, got {lengths}")
    return at, *lengths
