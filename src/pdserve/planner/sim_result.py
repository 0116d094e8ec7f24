"""What a simulation reports of a run: each finished request's TTFT and TPOT, the workers' busy shares, and the demand
on a host's shared cores."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.workload import SimRequest


@dataclass(frozen=True)
class SimResult:
    ttft_s: list[float]  # of every request that finished
    tpot_s: list[float | None]  # of the same; None for fewer than 2 tokens, which have none (as loadgen)
    rejected: int  # not served: could never fit a worker's KV, or shed
    shed: int  # of those, shed by admission
    span_s: float  # first arrival to last completion
    prefill_busy: float  # share of the span the prefill (or colocated) workers spent stepping
    decode_busy: float
    busy_s: float  # engine-thread seconds, every worker summed
    # The cores the run asked of a host the workers share, on average while requests arrived: every step's work
    # at full speed (its threads), the serving stack's CPU per request and the background. Over the cores, the
    # host falls ever further behind, however a finite trace's percentiles look.
    demand_cores: float


def sim_result(
    p: HardwareProfile,
    requests: list[tuple[SimRequest, float | None, float | None]],
    shed: int,
    busy_s: tuple[list[float], list[float], float],
    work_s: float,
) -> SimResult:
    """`requests` in order of arrival, each with when its first token came and when it finished (None: it did not);
    `busy_s`: each prefill (or colocated) worker's stepping seconds, each decode worker's, every worker's summed;
    `work_s`: every step's work at full speed, summed."""
    done = [(r, first_s, done_s) for r, first_s, done_s in requests if done_s is not None and first_s is not None]
    start = requests[0][0].arrival_s if requests else 0.0
    span = max((done_s for _, _, done_s in done), default=start) - start
    tpot = [(done_s - first_s) / (r.output_len - 1) if r.output_len > 1 else None for r, first_s, done_s in done]
    prefill_s, decode_s, total_s = busy_s

    def busy(workers_s: list[float]) -> float:
        return sum(workers_s) / (len(workers_s) * span) if span > 0 else 0.0

    return SimResult(
        ttft_s=[first_s - r.arrival_s for r, first_s, _ in done],
        tpot_s=tpot,
        rejected=len(requests) - len(done),
        shed=shed,
        span_s=span,
        prefill_busy=busy(prefill_s),
        decode_busy=busy(decode_s),
        busy_s=total_s,
        demand_cores=_demand_cores(p, [r for r, _, _ in requests], work_s),
    )


def _demand_cores(p: HardwareProfile, requests: list[SimRequest], work_s: float) -> float:
    arrivals_s = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
    if arrivals_s <= 0:
        return p.background_cores
    threads = int(p.meta.get("threads", 1))
    return (work_s * threads + len(requests) * p.serving_cpu_s) / arrivals_s + p.background_cores
