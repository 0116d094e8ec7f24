"""The factor on predictions made under load, learned from requests that did not run alone: it moves a loaded
prediction toward what loaded requests measured, adds no more than the queue's length allows (a request placed with
none is predicted as before, so only the load can make a retry succeed), and the relay teaches it from loaded
requests only."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from pdserve.config import RouterConfig
from pdserve.protocol.sampling import SamplingParams
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.router.generation import generate
from services.router.load_calibration import MAX_FACTOR, MIN_FACTOR, LoadCalibration
from services.router.load_tracker import LoadTracker
from services.router.predictor import Predictor
from services.router.request import RoutedRequest
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, prompt, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
QUEUED = dict(queued_prefill_tokens=1500, queued_prefill_prompts=1, queued_prefill_token_squares=1500**2)


def test_the_factor_moves_toward_what_loaded_requests_measured_per_worker():
    cal = LoadCalibration(alpha=0.3)
    for _ in range(40):  # own 0.2 s behind 0.4 s of queueing: the 0.4 s and 0.2 s of its own shared took 1.5x
        cal.observe("p0", own_s=0.2, queue_s=0.4, measured_s=0.2 + 1.5 * 0.6 - 0.2)
    assert cal.factor("p0") == pytest.approx(1.5, rel=1e-3)
    assert cal.queueing_s("p0", own_s=0.2, queue_s=0.4) == pytest.approx(1.5 * 0.6 - 0.2)
    assert cal.factor("p1") == 1.0  # only the worker it measured
    for _ in range(40):  # own 1 s behind 0.2 s: only 0.2 s of its own cost shared the queue's steps
        cal.observe("p1", own_s=1.0, queue_s=0.2, measured_s=1.0 + 1.5 * 0.4 - 0.2)
    assert cal.factor("p1") == pytest.approx(1.5, rel=1e-3)
    for _ in range(100):
        cal.observe("p0", own_s=0.2, queue_s=0.1, measured_s=10.0)
    assert cal.factor("p0") == MAX_FACTOR
    for _ in range(100):
        cal.observe("p0", own_s=0.2, queue_s=1.0, measured_s=0.2)
    assert cal.factor("p0") == MIN_FACTOR
    cal.observe("p2", own_s=0.2, queue_s=0.0, measured_s=1.0)  # no queueing: nothing to learn
    assert "p2" not in cal.worker_ids()


def test_a_short_prediction_moves_the_factor_as_much_as_it_weighs():
    """A ratio of averages: a request behind 20 ms of queueing that took 500 ms more than its own cost (a loaded
    host's noise) moves the factor little, where an average of ratios would move it by a share of 13x."""
    cal = LoadCalibration(alpha=0.3)
    for _ in range(40):
        cal.observe("p0", own_s=1.0, queue_s=1.0, measured_s=2.0)
    assert cal.factor("p0") == pytest.approx(1.0)
    cal.observe("p0", own_s=1.0, queue_s=0.02, measured_s=1.5)
    assert cal.factor("p0") < 1.2


def test_only_a_request_behind_queueing_is_scaled_and_what_is_added_counts_as_queueing():
    """Admission's promise: only the load can make a shed request's retry succeed, so the factor never touches the
    request's own cost, and a request with nothing ahead of it is predicted as before."""
    pred = Predictor(RouterConfig(), LoadTracker())
    idle, queued = worker("p0"), worker("p0", **QUEUED)
    own, queue = pred.own_ttft_s(idle, 500, 0), pred.queue_s(queued)
    assert queue > 0
    for _ in range(200):
        pred.load_calibration.observe("p0", own_s=1.0, queue_s=1.0, measured_s=1.0 + 1.5 * 2 - 1.0)
    assert queue > own  # so the whole own cost is shared: all of the prediction is scaled
    assert pred.ttft_s(queued, 500, 0) == pytest.approx(1.5 * (own + queue), rel=1e-3)
    assert pred.own_ttft_s(queued, 500, 0) == pytest.approx(own)
    assert pred.ttft_s(idle, 500, 0) == pytest.approx(own)
    assert pred.load_calibration.queueing_s("p0", own, 0.0) == 0.0
    for _ in range(200):  # a factor under 1 takes off queueing, never the request's own cost
        pred.load_calibration.observe("p0", own_s=1.0, queue_s=1.0, measured_s=0.3)  # under its own cost
    assert pred.load_calibration.factor("p0") == MIN_FACTOR
    assert MIN_FACTOR * (own + queue) < own  # what the factor would make of the whole
    assert pred.ttft_s(queued, 500, 0) == pytest.approx(own)


def test_a_short_queue_adds_about_as_much_as_it_is_long():
    """A step's worth of queueing (say, a heartbeat's stale count of the decode worker's streams) in front of a long
    prompt adds about the factor times that step: the request shares nothing longer with it. Scaled whole, a factor
    learned under a burst shed a request on an idle cluster (RESOURCE_EXHAUSTED, its 2 s "queued" being 3x its own
    cost)."""
    cal = LoadCalibration()
    for _ in range(200):
        cal.observe("p0", own_s=1.0, queue_s=1.0, measured_s=1.0 + 4 * 2 - 1.0)
    assert cal.factor("p0") == pytest.approx(MAX_FACTOR)
    assert cal.queueing_s("p0", own_s=1.5, queue_s=0.05) == pytest.approx(MAX_FACTOR * 0.1 - 0.05)


def test_the_placement_carries_the_queue_before_and_after_the_factor():
    router = Router([worker("p0", **QUEUED), worker("d0", "decode")])
    for _ in range(200):
        router.predictor.load_calibration.observe("p0", own_s=1.0, queue_s=1.0, measured_s=1.0 + 2 * 2 - 1.0)
    placed = router.place(prompt(100), 8, 1.0)
    assert placed.profiled_queue_s == pytest.approx(placed.prefill_queue_s)  # an idle decode worker: no step to wait
    assert placed.queue_s == pytest.approx(2 * (placed.own_ttft_s + placed.profiled_queue_s) - placed.own_ttft_s)
    assert placed.predicted_ttft_s == pytest.approx(2 * (placed.own_ttft_s + placed.profiled_queue_s))


class LoadCostsTwice(StandInDecode):
    """A first token after each request's planned time."""

    def __init__(self, plan: dict[str, float]) -> None:
        super().__init__()
        self.plan = plan

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        await asyncio.sleep(self.plan[request.request_id])
        yield pb.GenerateResponse(token_ids=[3])
        yield pb.GenerateResponse(token_ids=[4], finish_reason=pb.FINISH_REASON_LENGTH)


async def test_the_relay_learns_the_load_factor_from_loaded_requests_and_the_other_from_those_alone():
    """A request alone, then a pair on the same prefill worker, the second placed while the first waits for its
    first token (so neither ran alone): a request alone takes its prediction, the second of a pair what a factor
    of 2 predicts. That factor climbs toward 2; the one learned from requests alone stays near 1 (it is taught the
    prediction before the load's factor)."""
    plan: dict[str, float] = {}
    async with serving(LoadCostsTwice(plan)) as address:
        router = Router([worker("p0"), worker("d0", "decode", address=address)])
        load_cal, cal = router.predictor.load_calibration, router.predictor.calibration

        async def admitted(ticket: Ticket) -> None:
            p = ticket.placement
            shared_s = min(p.own_ttft_s, p.profiled_queue_s)
            plan[ticket.key] = p.own_ttft_s + 2 * (p.profiled_queue_s + shared_s) - shared_s

        async def one(seed: int) -> None:
            request = pb.GenerateRequest(
                prompt_token_ids=[1 + (seed * 37 + j) % 250 for j in range(100)],
                sampling=pb.SamplingParams(max_tokens=2),
            )
            [msg async for msg in generate(router.lifecycle(), request, {}, lambda: None, admitted)]

        for i in range(6):
            await one(3 * i)
            first = asyncio.ensure_future(one(3 * i + 1))
            await asyncio.sleep(0.02)  # placed, its first token not back
            await asyncio.gather(first, one(3 * i + 2))
    assert load_cal.factor("p0") > 1.35, load_cal.factor("p0")
    assert 0.7 < cal.factor("p0") < 1.4, cal.factor("p0")


def test_a_request_alone_teaches_calibration_its_prediction_before_the_load_factor() -> None:
    """Placed behind another router's queue (which the worker reports as its wait) with the load's factor at 2, a
    request that ran alone as far as this router saw and took what the profiles predicted leaves the factor learned
    from requests alone at 1: that factor is taught the prediction without the load's, which it would otherwise
    learn to undo."""
    router = Router([worker("p0", **QUEUED), worker("d0", "decode")])
    for _ in range(200):
        router.predictor.load_calibration.observe("p0", own_s=1.0, queue_s=1.0, measured_s=1.0 + 2 * 2 - 1.0)
    placed = router.place(prompt(64), 8, 1.0)
    assert placed.predicted_ttft_s > 1.5 * (placed.own_ttft_s + placed.profiled_queue_s)
    req = RoutedRequest("client", prompt(64), SamplingParams(max_tokens=8), 0.0, 0.0, 0)
    ticket = Ticket("key", "client", req, placed, 0.0, router.tracker, router.admission)
    ticket.alone_ttft_s = placed.own_ttft_s + placed.profiled_queue_s

    async def calibrate() -> None:
        router.lifecycle().relay._calibrate(ticket, None)

    asyncio.run(calibrate())
    assert router.predictor.calibration.factor("p0") == pytest.approx(1.0)


@pytest.mark.parametrize("cached", [0, 32])
def test_a_prefix_cache_hit_teaches_the_load_factor_nothing(cached: int) -> None:
    """Its TTFT holds the reading of its cached tokens, which its own cost as predicted leaves out (calibration.py's
    rule too)."""
    router = Router([worker("p0", **QUEUED), worker("d0", "decode")])
    placed = replace(router.place(prompt(64), 8, 1.0), cached_tokens=cached)
    assert placed.profiled_queue_s > 0

    async def calibrate() -> None:
        router.lifecycle().relay._calibrate_load(placed, 3 * placed.predicted_ttft_s)

    asyncio.run(calibrate())
    factor = router.predictor.load_calibration.factor("p0")
    assert factor == 1.0 if cached else factor > 1.0


def test_a_request_with_no_queueing_teaches_the_load_factor_nothing() -> None:
    """Placed with nothing ahead of it (as far as this router saw), its prediction is never scaled: the factor is
    not for it, however slow it was."""
    router = Router([worker("p0"), worker("d0", "decode")])
    placed = router.place(prompt(64), 8, 1.0)
    assert placed.profiled_queue_s == 0

    async def calibrate() -> None:
        router.lifecycle().relay._calibrate_load(placed, 3 * placed.predicted_ttft_s)

    asyncio.run(calibrate())
    assert router.predictor.load_calibration.factor("p0") == 1.0
