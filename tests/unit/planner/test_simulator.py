"""The simulator against what queueing theory and the profile say it must give."""

from __future__ import annotations

import pytest

from pdserve.planner.plan import SLO, simulate
from pdserve.planner.simulator import Shape, Simulator
from pdserve.planner.workload import SimRequest, synthetic
from tests.unit.planner.synthetic import PERF, synthetic_profile


def test_a_lone_request_costs_its_prefill_and_its_decode_steps() -> None:
    profile = synthetic_profile()
    result = Simulator(profile, Shape(prefill=1, decode=1)).run([SimRequest(0.0, 256, 11)])
    assert result.ttft_s == [pytest.approx(PERF.prefill_s(256))]
    # each of the 10 decode steps reads the prompt and what it generated so far
    steps = [PERF.decode_step_s(1) + 1e-7 * (256 + k) for k in range(1, 11)]
    transfer = profile.transfer_s(256)
    assert result.tpot_s == [pytest.approx((transfer + sum(steps)) / 10)]


def test_utilisation_is_the_offered_load_below_saturation() -> None:
    """Utilisation law: busy share = rate x service time / servers, for prefill alone (no batching at low load)."""
    profile, rate, n = synthetic_profile(), 2.0, 400
    requests = synthetic(rate, 512, 8, n, seed=1).at_rate(rate)
    result = Simulator(profile, Shape(prefill=2, decode=1)).run(requests)
    offered = (n / result.span_s) * PERF.prefill_s(512) / 2
    assert result.prefill_busy == pytest.approx(offered, rel=0.1)
    assert 0 < result.prefill_busy < 1 and 0 < result.decode_busy < 1


def test_attainment_falls_as_rate_rises_and_goodput_saturates() -> None:
    profile, slo = synthetic_profile(), SLO(ttft_ms=400, tpot_ms=40)
    workload = synthetic(1.0, 512, 32, 150, seed=2)
    outcomes = [simulate(profile, Shape(prefill=1, decode=1), workload, r, slo) for r in (1, 4, 8, 12, 20)]
    attainment = [o.attainment for o in outcomes]
    assert attainment == sorted(attainment, reverse=True)
    assert attainment[0] == 1.0 and attainment[-1] < 0.5
    capacity = 1 / PERF.prefill_s(512)  # one prefill worker: ~8.8 prompts/s at most
    assert max(o.goodput for o in outcomes) <= capacity * 1.05


def test_kv_capacity_bounds_the_decode_batch() -> None:
    """Two sequences' KV fit; a third waits for one to finish, so its TPOT clock starts late."""
    profile = synthetic_profile(kv_capacity_tokens=2 * (100 + 50))
    requests = [SimRequest(0.0, 100, 50) for _ in range(3)]
    result = Simulator(profile, Shape(prefill=1, decode=1)).run(requests)
    assert result.rejected == 0
    assert max(result.tpot_s) > 1.5 * min(result.tpot_s)
    too_big = Simulator(profile, Shape(prefill=1, decode=1)).run([SimRequest(0.0, 400, 1)])
    assert too_big.rejected == 1


def test_colocated_prefill_slows_the_decodes_in_its_steps() -> None:
    """The interference disaggregation removes: long prompts arriving during a decode stretch its TPOT."""
    profile = synthetic_profile()
    requests = [SimRequest(0.0, 64, 200)] + [SimRequest(0.05 + 0.2 * i, 2048, 2) for i in range(5)]
    colocated = Simulator(profile, Shape(colocated=1)).run(requests)
    split = Simulator(profile, Shape(prefill=1, decode=1)).run(requests)
    assert colocated.tpot_s[0] > 1.5 * split.tpot_s[0]


def test_a_calibrated_serving_overhead_delays_the_first_token_and_occupies_the_worker() -> None:
    profile = synthetic_profile(request_overhead_s=0.05)
    requests = [SimRequest(0.0, 256, 2), SimRequest(0.0, 256, 2)]
    result = Simulator(profile, Shape(prefill=1, decode=1)).run(requests)
    # the first arrival starts a step alone; the second waits for it, overhead included
    one = PERF.prefill_s(256) + 0.05
    assert result.ttft_s == [pytest.approx(one), pytest.approx(2 * one)]
