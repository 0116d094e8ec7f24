"""A first token's fixed cost per prefill worker, fitted apart from the compute's factor: it converges on a synthetic
c + f * compute, a few slow outliers move it little, it stays within [0, MAX_FIXED_S] and at 0 until it has seen
enough; the relay teaches it before the factor (which then learns only what is left), and the offer admission
judges SLOs against counts it at its least of the last window."""

from __future__ import annotations

import asyncio
import random
import re
import statistics

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.protocol.sampling import SamplingParams
from services.router import best_speed
from services.router.calibration import MAX_FACTOR
from services.router.fixed_cost import MAX_FIXED_S, MIN_SAMPLES, WINDOW, FixedCost
from services.router.request import RoutedRequest
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, prompt, shed, worker

FIXED_S, FACTOR = 0.045, 1.5  # tiny-random on the 2-core VM: ~45 ms of hops around a few ms of compute


def computes(n: int, seed: int = 0) -> list[float]:
    """Prompts' computes spread as chat prompts' lengths are (log-normal), 1-30 ms."""
    rng = random.Random(seed)
    return [min(0.03, max(0.001, rng.lognormvariate(0.0, 0.7) * 0.006)) for _ in range(n)]


def test_it_converges_on_a_fixed_cost_plus_a_factor_times_the_compute_per_worker():
    fixed, rng = FixedCost(), random.Random(1)
    for compute in computes(64):
        fixed.observe("p0", compute, FIXED_S + FACTOR * compute + rng.uniform(-0.002, 0.002))
    assert fixed.fixed_s("p0") == pytest.approx(FIXED_S, abs=0.003)
    assert fixed.fixed_s("p1") == 0.0  # only the worker it measured


def test_it_stays_at_zero_until_enough_requests_taught_it():
    """A first request alone may be a warm-up's: one slow TTFT must not set a fixed cost every prompt then pays."""
    fixed = FixedCost()
    *first, last = computes(MIN_SAMPLES)
    for compute in first:
        assert fixed.observe("p0", compute, FIXED_S + FACTOR * compute) == 0.0
    assert fixed.observe("p0", last, FIXED_S + FACTOR * last) == pytest.approx(FIXED_S)


def test_a_few_slow_outliers_move_it_little():
    """One request alone in five takes 10x as long (a host's hiccup): a least-squares intercept would follow them,
    the median of slopes and the median intercept hardly move."""
    fixed = FixedCost()
    for i, compute in enumerate(computes(64, seed=2)):
        fixed.observe("p0", compute, (FIXED_S + FACTOR * compute) * (10 if i % 5 == 4 else 1))
    assert fixed.fixed_s("p0") == pytest.approx(FIXED_S, abs=0.005)


def test_it_stays_within_its_bounds():
    fixed = FixedCost()
    for compute in computes(MIN_SAMPLES * 2):
        fixed.observe("p0", compute, 5.0 + compute)
    assert fixed.fixed_s("p0") == MAX_FIXED_S
    for compute in computes(64, seed=3):  # faster than the factor's floor: none of it fixed
        fixed.observe("p1", compute, 0.1 * compute)
    assert fixed.fixed_s("p1") == 0.0
    fixed.observe("p1", 0.01, 0.0)  # nothing to learn from
    assert fixed.worker_ids() == {"p0", "p1"}
    assert fixed.forget("p0") and fixed.fixed_s("p0") == 0.0 and fixed.worker_ids() == {"p1"}


def test_what_the_factor_cannot_reach_falls_to_the_fixed_cost():
    """A compute 6x its profile is past the factor's cap of 4: the fixed cost takes the rest at the median size, so
    the typical prompt is still predicted right (an unbounded slope would leave it to a factor that stops at 4)."""
    fixed, xs = FixedCost(), computes(WINDOW, seed=5)
    for compute in xs:
        fixed.observe("p0", compute, 0.01 + 6 * compute)
    assert fixed.fixed_s("p0") == pytest.approx(0.01 + (6 - MAX_FACTOR) * statistics.median(xs), rel=1e-6)


def test_prompts_of_one_size_leave_it_what_the_factor_at_its_cap_cannot_explain():
    """With no two sizes, a fixed cost and a factor cannot be told apart: the factor keeps all it can reach, and
    the fixed cost is what lies beyond its cap, so the prediction of that size can still reach the TTFT."""
    fixed = FixedCost()
    for _ in range(MIN_SAMPLES):
        fixed.observe("p0", 0.006, FIXED_S + FACTOR * 0.006)
    assert fixed.fixed_s("p0") == pytest.approx(FIXED_S + FACTOR * 0.006 - MAX_FACTOR * 0.006)
    for _ in range(MIN_SAMPLES):
        fixed.observe("p1", 0.1, FIXED_S + FACTOR * 0.1)  # within the factor's reach: none
    assert fixed.fixed_s("p1") == 0.0


def teach(router: Router, tokens: list[int]) -> None:
    """The relay's lesson from a request alone on an idle p0 whose TTFT was FIXED_S + FACTOR * its compute, plus
    its KV transfer and its decode worker's step (none on an idle one) as predicted."""
    placed = router.place(tokens, 8, 1.0)
    assert placed.prefill_queue_s == 0
    req = RoutedRequest("client", tokens, SamplingParams(max_tokens=8), 0.0, 0.0, 0)
    ticket = Ticket("key", "client", req, placed, 0.0, router.tracker, router.admission)
    transfer_s = router.predictor.transfer_s(placed.prefill_worker, len(tokens))
    ticket.alone_ttft_s = FIXED_S + FACTOR * placed.compute_s + transfer_s + placed.profiled_queue_s
    ticket.release()

    async def calibrate() -> None:
        router.lifecycle().relay._calibrate(ticket, None)

    asyncio.run(calibrate())


def tiny_router() -> Router:
    """A prefill worker whose compute is a few ms a prompt (its profile at 1/50), as tiny-random's is."""
    return Router([worker("p0", speed_factor=0.02), worker("d0", "decode")])


def test_the_relay_teaches_the_fixed_cost_then_the_factor_what_is_left():
    """Requests alone of spread lengths, each FIXED_S + FACTOR * compute: the fixed cost comes to FIXED_S, and the
    factor, taught with it taken off, to FACTOR, not to its cap (where the factor alone stood, short prompts
    predicted at a fraction of their TTFT); short and long prompts are then predicted right."""
    router = tiny_router()
    rng = random.Random(4)
    for i in range(48):
        teach(router, prompt(min(1024, max(32, round(rng.lognormvariate(0.0, 0.7) * 256))), seed=i))
    assert router.predictor.fixed_cost.fixed_s("p0") == pytest.approx(FIXED_S, abs=0.003)
    assert router.predictor.calibration.factor("p0") == pytest.approx(FACTOR, rel=0.1)
    for n in (32, 1024):
        placed = router.place(prompt(n, seed=99), 8, 1.0)
        truth = FIXED_S + FACTOR * placed.compute_s + router.predictor.transfer_s(placed.prefill_worker, n)
        assert placed.predicted_ttft_s == pytest.approx(truth, rel=0.05), n
        assert placed.fixed_s == pytest.approx(FIXED_S, abs=0.003)


def test_a_busy_decode_workers_step_is_not_taken_for_a_fixed_cost():
    """A request alone on its prefill worker whose decode worker is busy waits for one of its steps, which the
    prediction holds apart (the decode wait): the fixed cost is learned from the TTFT less it."""
    router = Router([worker("p0", speed_factor=0.02), worker("d0", "decode", running=4)])
    assert router.place(prompt(64), 8, 1.0).profiled_queue_s > FIXED_S / 2
    for i in range(MIN_SAMPLES * 2):
        teach(router, prompt(64 * (1 + i % 8), seed=i))
    assert router.predictor.fixed_cost.fixed_s("p0") == pytest.approx(FIXED_S, abs=0.003)


def test_the_factor_is_taught_the_ttft_with_the_fixed_cost_taken_off_as_this_request_left_it():
    """Until the fixed cost is learned the factor climbs to its cap, as before; the request that teaches the fixed
    cost then moves the factor toward what the compute took at once (judged against the whole TTFT, or the fixed
    cost the prediction was made with, 0, the factor would stay at its cap a request longer), and a later request
    moves it by the share of its compute's error, not of the whole TTFT's (where a fixed cost dilutes it)."""
    router = tiny_router()
    cal = router.predictor.calibration
    for i in range(MIN_SAMPLES - 1):
        teach(router, prompt(64 * (1 + i), seed=i))
    assert cal.factor("p0") == MAX_FACTOR
    teach(router, prompt(512, seed=MIN_SAMPLES))
    assert router.predictor.fixed_cost.fixed_s("p0") > FIXED_S / 2
    assert cal.factor("p0") < 0.9 * MAX_FACTOR
    router = tiny_router()
    for i in range(MIN_SAMPLES):  # the fixed cost learned, the factor left at 1
        router.predictor.fixed_cost.observe("p0", 0.001 * (1 + i), FIXED_S + FACTOR * 0.001 * (1 + i))
    assert router.predictor.fixed_cost.fixed_s("p0") == pytest.approx(FIXED_S)
    teach(router, prompt(256))
    # 30% of the way to FACTOR, in log space
    assert router.predictor.calibration.factor("p0") == pytest.approx(FACTOR**0.3, rel=0.02)


def test_an_slo_below_the_fixed_cost_is_shed_with_a_hint_then_refused_naming_an_offer_that_is_admitted(monkeypatch):
    """The offer counts the fixed cost as the speed: in the first window after it was learned, at none (a cost first
    seen may be contention's, which passes: RESOURCE_EXHAUSTED with a hint); then at its least of the last window,
    so an SLO under it is INVALID_ARGUMENT naming a value the idle cluster admits, not one shed for ever."""
    now = [1000.0]
    monkeypatch.setattr(best_speed.time, "monotonic", lambda: now[0])
    router = tiny_router()
    for i in range(MIN_SAMPLES * 2):
        teach(router, prompt(64 * (1 + i % 8), seed=i))
    own = router.place(prompt(64, seed=50), 8, 1.0).own_ttft_s
    assert own > FIXED_S
    shed(router, prompt(64, seed=50), "TTFT", slo_s=(own - FIXED_S / 2, 1.0))
    now[0] += best_speed.WINDOW_S
    with pytest.raises(InvalidRequestError, match="slo.ttft_ms") as ttft:
        router.admit(prompt(64, seed=50), slo_s=(own - FIXED_S / 2, 1.0))
    offered_ms = int(re.search(r"can offer is (\d+) ms", str(ttft.value)).group(1))
    assert offered_ms >= own * 1e3
    router.admit(prompt(64, seed=50), slo_s=(offered_ms / 1e3, 1.0))


def test_a_request_queued_ahead_holds_its_prefill_worker_for_its_own_cost_less_the_fixed_cost():
    """The next prompt's compute overlaps most of a request's fixed cost (its calls before its prefill, its commit
    after): what it adds to the queue a later request is predicted behind is its own cost without it."""
    router = tiny_router()
    for i in range(MIN_SAMPLES * 2):
        teach(router, prompt(64 * (1 + i % 8), seed=i))
    placed = router.place(prompt(256, seed=60), 8, 1.0)
    assert placed.fixed_s == pytest.approx(FIXED_S, abs=0.003)
    req = RoutedRequest("client", prompt(256, seed=60), SamplingParams(max_tokens=8), 0.0, 0.0, 0)
    with Ticket("key", "client", req, placed, 0.0, router.tracker, router.admission):
        queued_s = router.predictor.queue_s(placed.prefill_worker)
        assert queued_s == pytest.approx(placed.own_ttft_s - FIXED_S, abs=0.003)
