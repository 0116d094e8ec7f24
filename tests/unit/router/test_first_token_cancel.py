"""A caller's cancel that lands again while the router waits for the first token (anyio's cancel scope, as Starlette
ends a stream whose client left, cancels at every await the task reaches) ends the request as cancelled. The first
token's wait ran the read as a task of its own (`asyncio.wait_for`): a second cancel left that read running, the
cleanup read the call again ("anext(): asynchronous generator is already running"), and the request was counted
failed with two error lines. The decode call here goes through an interceptor whose end takes a loop step, as the
tracing interceptor's sometimes does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.router.generation import generate
from services.router.ticket import Ticket
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)


class SilentDecode(StandInDecode):
    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        await asyncio.sleep(30)
        yield pb.GenerateResponse(token_ids=[3], finish_reason=pb.FINISH_REASON_LENGTH)


class SlowToEnd(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> AsyncIterator[Any]:
        call = await continuation(details, request)

        async def responses() -> AsyncIterator[Any]:
            try:
                async for response in call:
                    yield response
            finally:
                await asyncio.sleep(0)

        return responses()


class Intercepted(Telemetry):
    def client_interceptors(self) -> list[Any]:
        return [SlowToEnd()]


async def test_a_cancel_repeated_at_each_await_before_the_first_token_ends_the_request_cancelled(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    telemetry = Intercepted("test-router")

    async def admitted(ticket: Ticket) -> None:
        pass

    async with serving(SilentDecode()) as d0:
        lifecycle = Router([worker("p0"), worker("d0", "decode", address=d0)]).lifecycle(telemetry=telemetry)
        request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=1))

        async def consume() -> None:
            async for _ in generate(lifecycle, request, {}, lambda: None, admitted):  # no deadline, as over HTTP
                pass

        for cancels in (1, 2, 3):
            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.3)  # waiting for the first token
            for _ in range(cancels):
                task.cancel()
                await asyncio.sleep(0)
            with pytest.raises(asyncio.CancelledError):
                await task
    assert requests_by_outcome(telemetry) == {("cancelled", "anonymous"): 3}
    assert lifecycle.in_flight == 0
    telemetry.shutdown()
