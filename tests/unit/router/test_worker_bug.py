"""A worker's bug (an exception its handler did not expect) is INTERNAL to the caller: the request meets the same bug
on the next worker, so it neither moves nor ejects anyone; gRPC's own INTERNAL (a broken connection) is a lost
worker and moves the request. Through a real lifecycle against stand-in decode workers on real gRPC servers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.errors import InternalError
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.router.generation import generate
from services.router.http.errors import error_body
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
REQUEST = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=4))


class Buggy(StandInDecode):
    """Raises what its handler did not expect (the interceptor answers INTERNAL), or aborts with INTERNAL as gRPC's
    transport does for a reset stream."""

    def __init__(self, transport: bool) -> None:
        super().__init__()
        self.transport = transport

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.calls += 1
        if self.transport:
            await context.abort(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2")
        raise KeyError(f"a bug met by request {request.request_id}")
        yield pb.GenerateResponse()  # unreachable: makes this a stream handler


async def run(transport: bool) -> tuple[Exception, list[int], list[bool]]:
    """The caller's error, each of two decode workers' calls, and whether each was ejected."""

    async def admitted(ticket: Ticket) -> None:
        pass

    decodes = [Buggy(transport), Buggy(transport)]
    async with serving(decodes[0]) as a0, serving(decodes[1]) as a1:
        states = [worker("d0", "decode", address=a0), worker("d1", "decode", address=a1)]
        router = Router([worker("p0"), *states], max_attempts=3)
        with pytest.raises(Exception) as err:
            async for _ in generate(router.lifecycle(), REQUEST, {}, lambda: 10.0, admitted):
                pass
        assert a0 not in str(err.value) and a1 not in str(err.value)
        return err.value, [d.calls for d in decodes], [router.placement.ejections.ejected(s) for s in states]


async def test_a_workers_bug_reaches_the_caller_as_internal_and_moves_nothing() -> None:
    error, calls, ejected = await run(transport=False)
    assert type(error) is InternalError, error
    assert "internal error (error id" in str(error) and "a bug met" not in str(error), error
    assert sum(calls) == 1 and ejected == [False, False]
    status, body, _ = error_body(error)
    assert status == 500 and body["error"]["message"] == str(error)  # the worker's error id, not a new one


async def test_grpcs_own_internal_is_a_lost_worker_and_moves_the_request() -> None:
    error, calls, ejected = await run(transport=True)
    assert type(error).__name__ == "UnavailableError", error
    assert sum(calls) == 3 and any(ejected)
