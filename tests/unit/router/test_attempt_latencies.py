"""`pdserve status` judges each decode worker by its own attempts: a stream that moved after its first worker went
silent is not charged, as TPOT, to the worker that took it over and decoded it at speed. Through a real lifecycle
against stand-in decode workers on real gRPC servers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.router.generation import generate
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)


class GoesSilent(StandInDecode):
    """Streams three tokens, then nothing (a hung worker)."""

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        for i in range(3):
            yield pb.GenerateResponse(token_ids=[3 + i])
        await asyncio.sleep(3600)


async def test_a_moved_streams_stall_is_not_the_tpot_of_the_worker_that_took_it_over(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)

    async def admitted(ticket: Ticket) -> None:
        pass

    async with serving(GoesSilent()) as d0, serving(StandInDecode(gap_s=0.002)) as d1:
        decode = [worker("d0", "decode", address=d0), worker("d1", "decode", address=d1, kv_blocks_free=2048)]
        lc = Router([worker("p0"), *decode], stall_timeout_s=2.0).lifecycle()
        request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=8))
        tokens = [t async for msg in generate(lc, request, {}, lambda: 30.0, admitted) for t in msg.token_ids]
    assert len(tokens) == 8
    p50, p99 = lc.recent.quantiles("d1", "tpot")
    assert 0 < p99 < 0.05, (p50, p99)  # its own 5 tokens at ~2 ms; the request's TPOT holds d0's 2 s silence
