"""A stream its decode worker fails after tokens reached the caller, and the router cannot move: the caller's
UNAVAILABLE says how many tokens it got and that its output is partial (the same code ends a stream that never
started, and a caller retrying on it would start the output over). Before any token, the message is the failure's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.errors import UnavailableError
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.router.generation import generate
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)


class FailsAfter(StandInDecode):
    """Sends `tokens` tokens, then fails the call UNAVAILABLE (its engine died)."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        for i in range(self.tokens):
            yield pb.GenerateResponse(token_ids=[3 + i])
        await context.abort(grpc.StatusCode.UNAVAILABLE, "engine thread died")


async def failure_after(tokens: int) -> tuple[int, str]:
    async with serving(FailsAfter(tokens)) as d0:
        router = Router([worker("p0"), worker("d0", "decode", address=d0)], migration_limit=0, max_attempts=1)
        lifecycle = router.lifecycle()
        request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=16))

        async def admitted(ticket: Ticket) -> None:
            pass

        got = 0
        with pytest.raises(UnavailableError) as err:
            async for msg in generate(lifecycle, request, {}, lambda: None, admitted):
                got += len(msg.token_ids)
        return got, str(err.value)


async def test_a_stream_failed_mid_way_tells_the_caller_it_is_partial(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    got, message = await failure_after(3)
    assert got == 3 and "engine thread died" in message, message
    assert "the stream ended after 3 tokens, its output partial (a retry starts over)" in message, message
    got, message = await failure_after(0)
    assert got == 0 and "engine thread died" in message and "partial" not in message, message
