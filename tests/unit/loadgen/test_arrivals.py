"""Arrival times: gamma gaps at the asked mean rate, Poisson at burstiness 1, seeded, scaled as vLLM scales them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.arrivals import arrival_offsets, schedule
from loadgen.benchmark import BenchmarkConfig, drawn_requests
from loadgen.workload import Request, WorkloadConfig
from pdserve.request_rate import MAX_REQUEST_RATE


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gaps_have_the_asked_mean_and_gamma_spread(burstiness):
    rate, n = 8.0, 40_001
    gaps = np.diff(arrival_offsets(n, rate, burstiness, np.random.default_rng(1)))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # A gamma of shape k has coefficient of variation 1 / sqrt(k): 1 for Poisson.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_poisson_gaps_are_exponential():
    rate = 3.0
    gaps = np.sort(np.diff(arrival_offsets(5001, rate, 1.0, np.random.default_rng(2))))
    empirical = np.arange(1, len(gaps) + 1) / len(gaps)
    ks = np.max(np.abs(empirical - (1 - np.exp(-rate * gaps))))
    assert ks < 1.63 / math.sqrt(len(gaps))  # Kolmogorov-Smirnov at the 1% level


def test_increasing_seeded_and_the_last_at_n_over_the_rate_as_vllm_scales_them():
    a = arrival_offsets(50, 2.0, 1.0, np.random.default_rng(7))
    assert a[0] > 0 and np.all(np.diff(a) > 0)
    assert np.array_equal(a, arrival_offsets(50, 2.0, 1.0, np.random.default_rng(7)))
    assert not np.array_equal(a, arrival_offsets(50, 2.0, 1.0, np.random.default_rng(8)))
    for seed in range(20):  # the offered rate is the asked one whatever the seed
        assert arrival_offsets(100, 10.0, 1.0, np.random.default_rng(seed))[-1] == pytest.approx(10.0)


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(arrival_offsets(5, math.inf, 1.0, np.random.default_rng(0)), np.zeros(5))


def test_bad_rates_are_refused():
    rates = [(rate, 1.0) for rate in (0.0, -1.0, math.nan, 1.000001e6, 1e303)]
    for rate, burstiness in [*rates, *((1.0, burstiness) for burstiness in (0.0, 1e-300, 1e7))]:
        with pytest.raises(ValueError):
            arrival_offsets(3, rate, burstiness, np.random.default_rng(0))


def test_the_highest_rate_taken_still_draws_arrivals_spread_to_it():
    a = arrival_offsets(200, MAX_REQUEST_RATE, 1e6, np.random.default_rng(0))
    assert a[-1] == pytest.approx(200 / MAX_REQUEST_RATE) and len(np.unique(a)) == 200


@pytest.mark.parametrize("burstiness", [0.02, 1e6])
def test_either_end_of_the_burstiness_range_draws_arrivals_spread_to_the_rate(burstiness):
    """At 1e-300 every gamma gap underflowed to 0, and the run went all at once with no word; at 1e308 the scale
    1 / (rate * burstiness) did. The range's ends still draw distinct arrivals, the last at n / rate."""
    for seed in range(20):
        a = arrival_offsets(200, 10.0, burstiness, np.random.default_rng(seed))
        assert a[-1] == pytest.approx(20.0) and len(np.unique(a)) > 1


def test_schedule_sets_the_offsets_and_keeps_the_requests():
    requests = [Request([3, 4], 5), Request([5], 6), Request([7, 8, 9], 7)]
    scheduled = schedule(requests, 10.0, 1.0, np.random.default_rng(0))
    assert [r.prompt_token_ids for r in scheduled] == [r.prompt_token_ids for r in requests]
    assert [r.arrival_s for r in scheduled] == arrival_offsets(3, 10.0, 1.0, np.random.default_rng(0)).tolist()


def test_arrivals_depend_on_the_seed_rate_burstiness_and_count_alone_not_on_the_workload():
    """One generator drew the prompts and then the gaps: a longer --random-input-len moved every arrival."""
    short, long = (WorkloadConfig(num_prompts=20, random_input_len=n, random_range_ratio=0.5) for n in (8, 300))
    sharing = [WorkloadConfig(dataset_name="prefix-repetition", num_prompts=20, prefix_len=4), short]
    arrivals = [
        [r.arrival_s for r in drawn_requests(BenchmarkConfig("x:1", w, seed=5), run_index, 2.0)]
        for w in (short, long, *sharing)
        for run_index in (0, 1)
    ]
    assert all(a == arrivals[0] for a in arrivals)
    assert [r.arrival_s for r in drawn_requests(BenchmarkConfig("x:1", short, seed=6), 0, 2.0)] != arrivals[0]
    prompts = [drawn_requests(BenchmarkConfig("x:1", short, seed=5), i, 2.0)[0].prompt_token_ids for i in (0, 1)]
    assert prompts[0] != prompts[1]  # each rate of a sweep its own prompts, still
