"""The router's token latency metrics through a real lifecycle against a stand-in decode worker that sends
several tokens in one message (as a worker catching up does): one inter-token gap per token after the first."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest

from pdserve.protocol.sampling import SamplingParams
from pdserve.rpc.metadata import PREFILL_WAITED_KEY
from pdserve.security.api_keys import OPEN_TENANT, KeyTable, Tenant, digest
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.router.generation import generate
from services.router.request import RoutedRequest
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, prompt, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
MESSAGES = [[3, 4, 5], [6], [7, 8]]  # the first message carries three tokens


class Batched(StandInDecode):
    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        for i, tokens in enumerate(MESSAGES):
            await asyncio.sleep(0.05)
            last = i == len(MESSAGES) - 1
            yield pb.GenerateResponse(token_ids=tokens, finish_reason=pb.FINISH_REASON_LENGTH if last else 0)


@pytest.mark.parametrize("keys", [None, KeyTable({digest("k-1"): Tenant("team-a", "k-1")})], ids=["open", "keyed"])
async def test_every_token_after_the_first_is_one_inter_token_sample(keys):
    """TTFT and TPOT by tenant, as the end-to-end latency: one tenant's slow first tokens are its own (an open
    cluster's tenant is `anonymous`)."""

    async def admitted(ticket: Ticket) -> None:
        pass

    telemetry = Telemetry("test-router")
    request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=6))
    metadata = {"authorization": "Bearer k-1"} if keys else {}
    async with serving(Batched()) as address:
        lc = Router([worker("p0"), worker("d0", "decode", address=address)]).lifecycle(keys, telemetry=telemetry)
        got = [t async for msg in generate(lc, request, metadata, lambda: 10.0, admitted) for t in msg.token_ids]
    assert got == [t for m in MESSAGES for t in m]
    assert count(telemetry, "pdserve_inter_token_latency_seconds") == len(got) - 1
    tenant = "team-a" if keys else OPEN_TENANT
    for latency in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert count(telemetry, f"pdserve_{latency}_seconds", tenant=tenant) == 1, latency
    telemetry.shutdown()


def count(telemetry: Telemetry, histogram: str, **labels: str) -> float:
    return sum(
        s.value
        for f in telemetry.registry.collect()
        for s in f.samples
        if s.name == f"{histogram}_count" and labels.items() <= s.labels.items()
    )


async def test_calibration_learns_the_workers_ttft_from_the_dispatch_not_the_routers_wait_for_a_worker():
    """The request waits 1.5 s for a prefill worker to be listed, then its first token comes at once: the worker
    was fast, and its calibration factor must not grow for the router's wait (it would shed for it after). Its
    prediction is ~70 ms: counted from the router's receipt the factor would reach ~2.5; from the call, a loopback
    call slowed by a busy host moves it a little either way."""

    async def admitted(ticket: Ticket) -> None:
        pass

    request = pb.GenerateRequest(prompt_token_ids=list(range(1, 60)), sampling=pb.SamplingParams(max_tokens=2))
    async with serving(StandInDecode()) as address:
        router = Router([worker("d0", "decode", address=address)], no_workers_wait_s=3.0)
        lifecycle = router.lifecycle()
        asyncio.get_running_loop().call_later(1.5, router.registry.publish, worker("p0"))
        out = [msg async for msg in generate(lifecycle, request, {}, lambda: None, admitted)]
    assert out[-1].usage.ttft_ms >= 1400  # the caller's TTFT holds the wait
    assert router.predictor.calibration.factor("p0") < 1.5


class WaitedBehindAnotherRoutersPrompt(StandInDecode):
    """Its first token comes 1 s late; with `says`, its trailing metadata says the prefill worker held the prompt
    that long behind another router's (which this router's own count of the worker's queue cannot see)."""

    def __init__(self, says: bool) -> None:
        super().__init__()
        self.says = says

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        await asyncio.sleep(1.0)
        if self.says:
            context.set_trailing_metadata(((PREFILL_WAITED_KEY, "1000"),))
        yield pb.GenerateResponse(token_ids=[3])
        yield pb.GenerateResponse(token_ids=[4], finish_reason=pb.FINISH_REASON_LENGTH)


@pytest.mark.parametrize("says", [True, False])
async def test_calibration_takes_out_the_wait_the_prefill_worker_reports(says: bool):
    """Two routers share a prefill worker: a prompt placed alone as far as this router saw waited 1 s behind the
    other router's. That wait is no slowness of the worker's: the factor stays near 1, where it grew toward its
    cap on every such request (shedding later requests on an idle cluster as too slow for their SLO)."""

    async def admitted(ticket: Ticket) -> None:
        pass

    request = pb.GenerateRequest(prompt_token_ids=list(range(1, 60)), sampling=pb.SamplingParams(max_tokens=2))
    async with serving(WaitedBehindAnotherRoutersPrompt(says)) as address:
        router = Router([worker("p0"), worker("d0", "decode", address=address)])
        out = [msg async for msg in generate(router.lifecycle(), request, {}, lambda: None, admitted)]
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    factor = router.predictor.calibration.factor("p0")
    assert factor < 1.5 if says else factor > 2.0, factor


async def test_a_queue_the_prefill_worker_reported_is_in_the_prediction_the_reported_wait_is_taken_from():
    """The heartbeat showed another router's prompt queued: this router's prediction holds that queue, and the
    request still ran alone as far as this router's own sends go. A decode worker exactly as predicted (its first
    token after the queue and the own cost, the queue reported as the wait) keeps the factor at 1: the wait comes
    off the prediction too, not only off the TTFT (which drove the factor to its floor)."""
    plan: dict[str, tuple[float, float]] = {}

    class AsPredicted(StandInDecode):
        async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
            queue_s, own_s = plan[request.request_id]
            await asyncio.sleep(queue_s + own_s)
            context.set_trailing_metadata(((PREFILL_WAITED_KEY, str(round(queue_s * 1e3))),))
            yield pb.GenerateResponse(token_ids=[3])
            yield pb.GenerateResponse(token_ids=[4], finish_reason=pb.FINISH_REASON_LENGTH)

    async with serving(AsPredicted()) as address:
        queued = dict(queued_prefill_tokens=1500, queued_prefill_prompts=1, queued_prefill_token_squares=1500**2)
        router = Router([worker("p0", **queued), worker("d0", "decode", address=address)])
        calibration = router.predictor.calibration

        async def admitted(ticket: Ticket) -> None:
            p, factor = ticket.placement, calibration.factor("p0")
            plan[ticket.key] = (p.prefill_queue_s / factor, (p.predicted_ttft_s - p.prefill_queue_s) / factor)

        for i in range(4):
            router.registry.publish(worker("p0", **queued, load_at=time.time()))  # a fresh heartbeat
            prompt = [1 + (i * 37 + j) % 250 for j in range(400)]
            request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=2))
            [msg async for msg in generate(router.lifecycle(), request, {}, lambda: None, admitted)]
    assert 0.7 < calibration.factor("p0") < 1.4, calibration.factor("p0")


async def test_a_stream_its_caller_leaves_after_the_first_token_still_teaches_calibration():
    """Learned when the attempt ends, however it ends: without the worker's reported wait, from the whole TTFT."""

    async def admitted(ticket: Ticket) -> None:
        pass

    request = pb.GenerateRequest(prompt_token_ids=list(range(1, 60)), sampling=pb.SamplingParams(max_tokens=2))
    async with serving(WaitedBehindAnotherRoutersPrompt(says=True)) as address:
        router = Router([worker("p0"), worker("d0", "decode", address=address)])
        stream = generate(router.lifecycle(), request, {}, lambda: None, admitted)
        await anext(stream)
        await stream.aclose()
    assert router.predictor.calibration.factor("p0") > 2.0  # 1 s against a ~70 ms prediction


@pytest.mark.parametrize("cached", [0, 32])
def test_a_prefix_cache_hit_teaches_calibration_nothing(cached: int) -> None:
    """Its TTFT holds the reading of its cached tokens, which the prediction does not price: a review saw cache
    hits raise the worker's factor toward its cap, and the router then refuse every request with an SLO."""
    router = Router([worker("p0"), worker("d0", "decode")])
    placed = replace(router.place(prompt(64), 8, 1.0), cached_tokens=cached)
    req = RoutedRequest("client", prompt(64), SamplingParams(max_tokens=8), 0.0, 0.0, 0)
    ticket = Ticket("key", "client", req, placed, 0.0, router.tracker, router.admission)
    ticket.alone_ttft_s = 3 * placed.predicted_ttft_s

    async def calibrate() -> None:
        router.lifecycle().relay._calibrate(ticket, None)

    asyncio.run(calibrate())
    factor = router.predictor.calibration.factor("p0")
    assert factor == 1.0 if cached else factor > 1.0
