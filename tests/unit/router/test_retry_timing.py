"""A retried request's first token counts twice: for the caller from its arrival (its TTFT holds the failed
attempt), for the workers that served the retry from the retry's start. Otherwise one slow failure elsewhere
marks a healthy worker slow in `pdserve status` and in the router's TTFT correction for it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.router.generation import generate
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
LOST_S = 0.8
REQUEST = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=3))


class SlowlyLost(StandInDecode):
    """Fails after `LOST_S`, as a worker that dies mid-prefill does."""

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        await asyncio.sleep(LOST_S)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "engine thread is down")
        yield pb.GenerateResponse()  # unreachable: makes this a stream handler


async def test_the_worker_serving_a_retry_is_judged_by_the_retrys_own_ttft():
    async def admitted(ticket: Ticket) -> None:
        pass

    async with serving(SlowlyLost()) as d0, serving(StandInDecode()) as d1:
        # Placement prefers the most free blocks: the one that fails first.
        decodes = [worker("d0", "decode", address=d0), worker("d1", "decode", address=d1, kv_blocks_free=2048)]
        router = Router([worker("p0"), *decodes])
        lc = router.lifecycle()
        messages = [msg async for msg in generate(lc, REQUEST, {}, lambda: 10.0, admitted)]
    assert messages[-1].usage.ttft_ms >= LOST_S * 1e3  # the caller waited through the lost attempt
    served_p50, _ = lc.recent.quantiles("d1", "ttft")
    assert 0 < served_p50 < LOST_S / 2, served_p50
    prefill_p50, _ = lc.recent.quantiles("p0", "ttft")
    assert prefill_p50 < LOST_S / 2, prefill_p50
    assert lc.relay.calibration.factor("p0") < 2.5  # the lost attempt would have made it 3.4 or more
