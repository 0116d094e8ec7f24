"""`pdserve autoscale`'s decisions: the load over the window from cumulative counters, the re-planned split (toward
prefill as prompts grow, toward decode as outputs grow, the smallest cluster when idle, never past the cap), and
the hysteresis: a recommendation acts only after `consecutive` in a row, and never within the cooldown of a scale
that was made."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.planner import workload
from pdserve.planner.admission_model import AdmissionModel
from pdserve.planner.autoscale import (
    PLAN_REQUESTS,
    SMALLEST,
    Admitted,
    Hysteresis,
    Load,
    LoadWindow,
    bounded,
    recommend_counts,
    scale_down_rate,
    with_scale_down_margin,
)
from pdserve.planner.plan import SLO, candidate, recommend
from pdserve.planner.shape import Shape
from pdserve.planner.simulator import Simulator
from tests.unit.planner.synthetic import PERF, synthetic_profile

SLO_ = SLO(ttft_ms=1000, tpot_ms=100, attainment=0.9)
# One prefill worker takes ~0.33 s for a 400-token prompt: it sustains about 2.5 such prompts per second.
SLOW_PREFILL = synthetic_profile(perf=replace(PERF, prefill_per_token_s=0.0008))


def test_the_window_gives_rate_and_mean_lengths_from_differences() -> None:
    w = LoadWindow(window_s=4)
    w.observe(Admitted(0, 100, 10_000, 500))
    assert w.load() is None  # one sample spans nothing
    w.observe(Admitted(2, 104, 11_600, 520))
    assert w.load() is None  # not yet the whole window
    w.observe(Admitted(4, 108, 13_200, 540))
    assert w.load() == Load(rate=2.0, input_len=400.0, output_len=5.0)
    w.observe(Admitted(6, 108, 13_200, 540))
    w.observe(Admitted(8, 108, 13_200, 540))
    assert w.load() == Load(0.0, 0.0, 0.0) and w.load().idle  # the load went: the window holds none of it


def test_the_output_length_is_what_finished_requests_generated_when_some_finished() -> None:
    w = LoadWindow(window_s=2)
    w.observe(Admitted(0, 10, 1000, 10 * 4096, finished=8, completion_tokens=8 * 150))
    w.observe(Admitted(2, 14, 1400, 14 * 4096, finished=11, completion_tokens=8 * 150 + 3 * 90))
    assert w.load() == Load(rate=2.0, input_len=100.0, output_len=90.0)  # the 3 that finished, not max_tokens
    w.observe(Admitted(4, 16, 1600, 16 * 4096, finished=11, completion_tokens=8 * 150 + 3 * 90))
    assert w.load().output_len == 4096  # none finished in the window: what they may ask for


def test_the_rate_counts_the_requests_admission_shed_and_the_prompt_length_theirs_too() -> None:
    w = LoadWindow(window_s=2)
    w.observe(Admitted(0, 100, 10_000, 500))
    w.observe(Admitted(2, 106, 12_400, 560, shed=4, shed_prompt_tokens=4 * 400))
    assert w.load() == Load(rate=5.0, input_len=400.0, output_len=10.0)  # 6 admitted of 400 and 4 shed of 400
    w.observe(Admitted(4, 106, 12_400, 560, finished=6, completion_tokens=60, shed=10, shed_prompt_tokens=10 * 400))
    assert w.load() == Load(rate=3.0, input_len=400.0, output_len=10.0)  # all shed: the output seen last


def test_an_overloaded_cluster_is_scaled_for_the_load_offered_not_the_load_it_admitted() -> None:
    """1P:1D offered 10 req/s, more than it serves: the simulated router sheds over a fifth. Planned for what it
    admitted, the cluster would hold its size for ever (it admits about what it serves)."""
    profile, slo = synthetic_profile(), SLO(500, 60)
    arrivals = workload.synthetic(10, 512, 32, num_requests=400).at_rate(10)
    shed = Simulator(profile, Shape(1, 1), AdmissionModel(slo.ttft_ms / 1e3)).run(arrivals).rejected
    span, admitted = arrivals[-1].arrival_s - arrivals[0].arrival_s, len(arrivals) - shed
    assert shed > len(arrivals) / 5
    w = LoadWindow(window_s=span)
    w.observe(Admitted(0, 0, 0, 0))
    w.observe(Admitted(span, admitted, admitted * 512, admitted * 32, 0, 0, shed, shed * 512))
    assert w.load().rate == pytest.approx(len(arrivals) / span)
    assert recommend_counts(profile, Load(admitted / span, 512, 32), slo, max_workers=8) == SMALLEST
    assert sum(recommend_counts(profile, w.load(), slo, max_workers=8).values()) > 2


def test_autoscale_recommends_what_plan_recommends_with_the_routers_admission() -> None:
    """At a size where the router's admission matters (queues shed rather than grow), the two agree."""
    profile, slo = synthetic_profile(), SLO(500, 60)
    work = workload.synthetic(6, 1024, 64, num_requests=PLAN_REQUESTS)
    admission = AdmissionModel(slo.ttft_ms / 1e3)
    planned = recommend([candidate(profile, s, work, slo, admission) for s in (Shape(p, 4 - p) for p in (1, 2, 3))])
    counts = recommend_counts(profile, Load(6, 1024, 64), slo, max_workers=4)
    assert counts == {"prefill": planned.shape.prefill, "decode": planned.shape.decode} == {"prefill": 2, "decode": 2}


def test_lengths_spread_around_the_windows_means_as_plan_spreads_them() -> None:
    """An SRE review: the window's mean lengths alone recommended 1P:1D where plan, given the workload's spread
    (25%), said 1P:1D sustained a third less than the load; --range-ratio gives autoscale the spread."""
    load, slo = Load(8, 400, 16), SLO(400, 50)
    assert recommend_counts(synthetic_profile(), load, slo, 4, num_requests=200) == {"prefill": 1, "decode": 1}
    spread = recommend_counts(synthetic_profile(), load, slo, 4, num_requests=200, range_ratio=0.5)
    assert spread == {"prefill": 2, "decode": 1}


def test_a_router_restart_starts_the_window_again() -> None:
    w = LoadWindow(window_s=1)
    w.observe(Admitted(0, 500, 0, 0))
    w.observe(Admitted(1, 3, 30, 3))  # its counters began again at 0
    assert w.load() is None


def test_prefill_heavy_load_gets_a_second_prefill_worker_and_idle_gets_the_smallest_cluster() -> None:
    assert recommend_counts(SLOW_PREFILL, Load(1.0, 400, 4), SLO_, max_workers=3) == {"prefill": 1, "decode": 1}
    assert recommend_counts(SLOW_PREFILL, Load(4.0, 400, 4), SLO_, max_workers=3) == {"prefill": 2, "decode": 1}
    assert recommend_counts(SLOW_PREFILL, Load(0.0, 0, 0), SLO_, max_workers=3) == {"prefill": 1, "decode": 1}


def test_longer_outputs_move_the_split_toward_decode() -> None:
    short = recommend_counts(synthetic_profile(), Load(4.0, 256, 16), SLO(500, 60), max_workers=4)
    long = recommend_counts(synthetic_profile(), Load(4.0, 256, 200), SLO(500, 60), max_workers=4)
    assert short == {"prefill": 1, "decode": 1} and long == {"prefill": 1, "decode": 2}


def test_a_load_nothing_sustains_gets_the_best_split_of_the_cap() -> None:
    counts = recommend_counts(SLOW_PREFILL, Load(50.0, 400, 4), SLO_, max_workers=4)
    assert sum(counts.values()) == 4 and counts["prefill"] >= counts["decode"]
    with pytest.raises(ValueError, match="max-workers"):
        recommend_counts(SLOW_PREFILL, Load(1.0, 400, 4), SLO_, max_workers=1)


def test_splits_that_tie_get_the_split_plan_recommends() -> None:
    """A TPOT SLO under one idle decode step (10 ms): no split meets it at any rate, so all tie at 0 req/s, and at
    0 attainment and goodput; the cap's first split in plan's order, as `pdserve plan` recommends."""
    impossible = SLO(ttft_ms=500, tpot_ms=5, attainment=0.9)
    counts = recommend_counts(synthetic_profile(), Load(2.0, 512, 16), impossible, max_workers=3, num_requests=50)
    assert counts == {"prefill": 1, "decode": 2}


def test_a_smaller_cluster_only_when_it_would_sustain_the_windows_upper_rate_and_the_margin() -> None:
    """One prefill worker sustains 2.0 but not 2.2 of these prompts a second. Over a 60 s window 1.5 req/s reads
    at most ~1.82 (two standard deviations of a Poisson count), 2.2 with 20% more: 2P:1D holds; 1.2 goes down.
    Over a 3 s window a rate is far less sure: 1.2 holds too."""

    def recommend(load: Load) -> dict[str, int]:
        return recommend_counts(SLOW_PREFILL, load, SLO_, max_workers=3)

    two_prefill = {"prefill": 2, "decode": 1}
    counts, why = with_scale_down_margin(recommend, Load(1.5, 400, 4), two_prefill, margin=0.2, window_s=60)
    assert counts == two_prefill and why is not None and "but not 2.18" in why
    assert with_scale_down_margin(recommend, Load(1.5, 400, 4), two_prefill, 0.0, 60) == (SMALLEST, None)
    assert with_scale_down_margin(recommend, Load(1.2, 400, 4), two_prefill, 0.2, 60) == (SMALLEST, None)
    assert with_scale_down_margin(recommend, Load(1.2, 400, 4), two_prefill, 0.2, 3)[0] == two_prefill
    assert with_scale_down_margin(recommend, Load(0.0, 0, 0), two_prefill, 0.2, 3) == (SMALLEST, None)  # idle
    # Up as soon as the load needs it: the bound is for going down only.
    assert with_scale_down_margin(recommend, Load(2.2, 400, 4), SMALLEST, 0.2, 3) == (two_prefill, None)


def test_the_scale_down_rate_is_the_windows_upper_bound_and_the_margin_more() -> None:
    assert scale_down_rate(4.0, 100.0, 0.0) == pytest.approx(4.0 + 2 * 0.2)
    assert scale_down_rate(4.0, 100.0, 0.5) == pytest.approx((4.0 + 2 * 0.2) * 1.5)
    assert scale_down_rate(0.0, 3.0, 0.2) == 0.0


def test_bounds_keep_a_worker_per_role_and_the_cap() -> None:
    assert bounded({"prefill": 0, "decode": 0}, 4) == {"prefill": 1, "decode": 1}
    assert bounded({"prefill": 5, "decode": 2}, 4) == {"prefill": 2, "decode": 2}
    assert bounded({"prefill": 1, "decode": 1}, 1) == {"prefill": 1, "decode": 1}


def test_hysteresis_acts_after_consecutive_equal_recommendations_then_cools_down() -> None:
    small, big = {"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 1}
    h = Hysteresis(consecutive=2, cooldown_s=10)
    assert h.decide(0, small, big).target is None
    assert h.decide(1, small, small).target is None  # back at the current counts: the streak ends
    assert h.decide(2, small, big).target is None
    assert h.decide(3, small, big).target == big
    h.applied(3)  # ScaleWorkers took it
    assert h.decide(4, big, small).target is None
    decision = h.decide(5, big, small)
    assert decision.target is None and "cooling down" in decision.why  # two in a row, but 2 s after a change
    assert h.decide(12, big, small).target is None  # 9 s after the change
    assert h.decide(13, big, small).target == small  # the cooldown is over and the recommendation held


def test_a_different_recommendation_restarts_the_streak() -> None:
    h = Hysteresis(consecutive=2, cooldown_s=0)
    current = {"prefill": 1, "decode": 1}
    assert h.decide(0, current, {"prefill": 2, "decode": 1}).target is None
    assert h.decide(1, current, {"prefill": 1, "decode": 2}).target is None
    assert h.decide(2, current, {"prefill": 1, "decode": 2}).target == {"prefill": 1, "decode": 2}


def test_only_a_scale_that_was_made_starts_the_cooldown() -> None:
    small, big = {"prefill": 1, "decode": 1}, {"prefill": 2, "decode": 2}
    h = Hysteresis(consecutive=2, cooldown_s=120)
    assert h.decide(0, small, big).target is None
    assert h.decide(10, small, big).target == big  # ScaleWorkers UNAVAILABLE: nothing changed
    assert h.decide(20, small, big).target == big  # asked again at once, not after the cooldown
    h.applied(20)
    assert h.decide(30, big, small).target is None
    assert "cooling down" in h.decide(40, big, small).why
    assert h.decide(140, big, small).target == small
