"""Every prefill:decode split of K workers and K colocated ones, simulated at the workload's rate, and the
highest rate each sustains at the SLO attainment target (found by bisection, as DistServe searches the rate
per configuration). The recommended split is the one that sustains the highest rate; ties go to the better
attainment and goodput at the asked rate. With a model of the router's admission (`AdmissionModel`) the simulation
sheds what the router would, so a rate above a split's capacity shows the goodput the cluster keeps, not a collapse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.planner.admission_model import AdmissionModel
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.shape import Shape
from pdserve.planner.sim_result import SimResult
from pdserve.planner.simulator import Simulator
from pdserve.planner.step_costs import decode_token_s, prefill_work_s
from pdserve.planner.workload import Workload

SEARCH_STEPS = 8  # bisection steps: the rate to within 1/256 of its bracket (a doubling)
MAX_DOUBLINGS = 20


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ValueError("the TTFT and TPOT SLOs must be > 0 ms")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")


@dataclass(frozen=True)
class Outcome:
    """One shape at one rate."""

    attainment: float  # share of all requests (rejected ones too) that met both SLOs
    goodput: float  # requests/s that met both SLOs, over the span as loadgen measures it
    ttft_ms: tuple[float, float, float]  # p50, p90, p99; inf where no request gave one
    tpot_ms: tuple[float, float, float]
    prefill_busy: float
    decode_busy: float
    demand_cores: float  # of a host whose cores the workers share (SimResult.demand_cores)
    shed: float = 0.0  # share of all requests the router's admission shed


def outcome(result: SimResult, total: int, slo: SLO) -> Outcome:
    """As loadgen counts: a request without a TPOT (fewer than 2 tokens) meets any TPOT SLO and is left out of
    the TPOT percentiles."""
    ttft = np.array(result.ttft_s) * 1e3
    tpot = np.array([t for t in result.tpot_s if t is not None]) * 1e3
    meets_tpot = np.array([t is None or t * 1e3 <= slo.tpot_ms for t in result.tpot_s], dtype=bool)
    good = int(np.sum((ttft <= slo.ttft_ms) & meets_tpot)) if len(ttft) else 0

    def pct(x: np.ndarray) -> tuple[float, float, float]:
        if not len(x):
            return (math.inf, math.inf, math.inf)
        return tuple(float(v) for v in np.percentile(x, [50, 90, 99]))  # type: ignore[return-value]

    return Outcome(
        attainment=good / total if total else 0.0,
        goodput=good / result.span_s if result.span_s > 0 else 0.0,
        ttft_ms=pct(ttft),
        tpot_ms=pct(tpot),
        prefill_busy=result.prefill_busy,
        decode_busy=result.decode_busy,
        demand_cores=result.demand_cores,
        shed=result.shed / total if total else 0.0,
    )


def simulate(
    profile: HardwareProfile,
    shape: Shape,
    workload: Workload,
    rate: float,
    slo: SLO,
    admission: AdmissionModel | None = None,
) -> Outcome:
    requests = workload.at_rate(rate)
    return outcome(Simulator(profile, shape, admission).run(requests), len(requests), slo)


def max_rate(
    profile: HardwareProfile, shape: Shape, workload: Workload, slo: SLO, admission: AdmissionModel | None = None
) -> float:
    """The highest rate at which `shape` still meets the attainment target; 0 when even an idle one does not.
    Never past the rate it can keep up with (`sustainable_rate`), nor, where the workers share a host's cores,
    one that asks more of them than there are: the trace is finite, and a cluster that falls ever further behind
    can still meet the target over its few seconds (at a high enough rate the trace is one burst)."""
    bound = sustainable_rate(profile, shape, workload)

    def meets(rate: float) -> bool:
        o = simulate(profile, shape, workload, rate, slo, admission)
        cores = not profile.shared_cores or o.demand_cores <= profile.shared_cores
        return rate <= bound and o.attainment >= slo.attainment and cores

    # From the workload's rate, but never past the bound: asked far above it (a rate for more workers than these),
    # the near-idle start (rate / 1024) was itself past the bound, every shape read as one that fails even idle, and
    # a bracket as wide as the asked rate left the bisection short of the max rate.
    start = min(workload.rate, bound)
    lo = start / 1024
    if not meets(lo):
        return 0.0
    # Or near the bound when that is far above the rate (a trace of a few requests over hours): the doublings would
    # run out before reaching it, and every split would tie at the same cap.
    hi = max(start, bound / 64) if math.isfinite(bound) else start
    for _ in range(MAX_DOUBLINGS):
        if not meets(hi):
            break
        lo, hi = hi, hi * 2
    else:
        return lo  # every doubling met: the last one tried, not the next, which never ran
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def sustainable_rate(profile: HardwareProfile, shape: Shape, workload: Workload) -> float:
    """The rate past which a phase has more work than its workers have time: prompts prefill one a step on a
    prefill worker (cluster/worker_spec.py), in full steps on a colocated one, and tokens after the first (which the
    prefill makes) decode at best in full batches (`max_num_seqs`, or as many sequences as the KV holds)."""
    p = profile
    prefill_s = float(np.mean([prefill_work_s(p, n, packed=bool(shape.colocated)) for n in workload.input_lens]))
    out, seq_tokens = workload.mean_output_len, workload.mean_input_len + workload.mean_output_len
    batch = max(1, min(p.max_num_seqs, int(p.kv_capacity_tokens // seq_tokens)))
    decode_s = max(out - 1, 0) * decode_token_s(p, batch, workload.mean_input_len + out / 2)
    if shape.colocated:
        return shape.colocated / (prefill_s + decode_s)
    return min(shape.prefill / prefill_s, shape.decode / decode_s if decode_s else math.inf)


@dataclass(frozen=True)
class Candidate:
    shape: Shape
    at_rate: Outcome
    max_rate: float

    def as_json(self) -> dict[str, Any]:
        return {
            "prefill": self.shape.prefill,
            "decode": self.shape.decode,
            "colocated": self.shape.colocated,
            "goodput": self.at_rate.goodput,
            "attainment": self.at_rate.attainment,
            "ttft_p90_ms": _sampled(self.at_rate.ttft_ms[1]),
            "tpot_p90_ms": _sampled(self.at_rate.tpot_ms[1]),
            "max_rate": self.max_rate,
            "shed": self.at_rate.shed,
        }


def _sampled(ms: float) -> float | None:
    """None (JSON null) where no request gave a value: JSON has no Infinity, and loadgen's 0 would read as the
    best latency of all for a split that served nothing."""
    return ms if math.isfinite(ms) else None


def shapes(workers: int) -> list[Shape]:
    if workers < 2:
        raise ValueError(f"--workers must be at least 2 to split, got {workers}")
    return [Shape(prefill=p, decode=workers - p) for p in range(1, workers)] + [Shape(colocated=workers)]


def candidate(
    profile: HardwareProfile, shape: Shape, workload: Workload, slo: SLO, admission: AdmissionModel | None = None
) -> Candidate:
    return Candidate(
        shape,
        simulate(profile, shape, workload, workload.rate, slo, admission),
        max_rate(profile, shape, workload, slo, admission),
    )


def plan(
    profile: HardwareProfile, workload: Workload, slo: SLO, workers: int, admission: AdmissionModel | None = None
) -> list[Candidate]:
    return [candidate(profile, s, workload, slo, admission) for s in shapes(workers)]


def recommend(candidates: list[Candidate]) -> Candidate:
    """The best disaggregated split (what `pdserve scale` can apply). Where every measure ties (as when no split
    meets the SLO at any rate), the first in `shapes`' order: the fewest prefill workers."""
    splits = [c for c in candidates if not c.shape.colocated]
    return max(splits, key=lambda c: (c.max_rate, c.at_rate.attainment, c.at_rate.goodput))


def plan_json(candidates: list[Candidate]) -> dict[str, Any]:
    best = recommend(candidates)
    return {
        "recommended": {"prefill": best.shape.prefill, "decode": best.shape.decode},
        "candidates": [c.as_json() for c in candidates],
    }
