"""A gRPC caller that takes none of its stream (its flow-control window full, not reading, not gone) is taken as
gone after reader_stall_timeout_s: its request ends cancelled and gives back its router slot and decode call at
once, and the caller, when it reads again, gets what was sent and then CANCELLED saying why. Before, the request
held its slot until the caller read or left: enough such callers shed every other one. A real gRPC server, the
router's servicer and lifecycle, a stand-in decode worker; the client's window is kept small (no BDP probing, no
lookahead), as a client that stops reading leaves it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.rpc.server import Server
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from services.router.servicer import GenerationServicer
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 0)]


class TwoBigMessages(worker_pb2_grpc.DecodeWorkerServicer):
    """20,000 tokens, then 20,000 more with the finish reason: the caller's small window holds the first alone."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        yield pb.GenerateResponse(token_ids=[5] * 20_000)
        yield pb.GenerateResponse(token_ids=[5] * 20_000, finish_reason=pb.FINISH_REASON_LENGTH)


@asynccontextmanager
async def stalled_caller(decode: Any, telemetry: Telemetry) -> AsyncIterator[tuple[Router, Any, Any]]:
    """The router (a 0.5 s reader stall bound) on a real gRPC server before `decode`, and a call to it that has
    read its first message and then reads nothing for 2 s, on a channel of a small window."""
    async with serving(decode) as d0:
        router = Router([worker("p0"), worker("d0", "decode", address=d0)], reader_stall_timeout_s=0.5)
        lifecycle = router.lifecycle(telemetry=telemetry)
        server = Server("127.0.0.1", 0)
        server.add(lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(lifecycle), s), [])
        await server.start()
        request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=4000))
        try:
            async with grpc.aio.insecure_channel(server.address, options=SMALL_WINDOW) as ch:
                call = generate_pb2_grpc.GenerationStub(ch).Generate(request)
                first = await call.read()
                await asyncio.sleep(2.0)
                yield router, lifecycle, (call, first)
        finally:
            await server.stop(None)


async def test_a_caller_that_stops_reading_is_ended_aborted_and_its_slot_given_back(monkeypatch) -> None:
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    telemetry = Telemetry("test-router")
    async with stalled_caller(StandInDecode(), telemetry) as (router, lifecycle, (call, _)):
        assert lifecycle.in_flight == 0 and not router.tracker.decoding["d0"]  # before it read again
        assert requests_by_outcome(telemetry) == {("cancelled", "anonymous"): 1}
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            while await call.read() is not grpc.aio.EOF:
                pass
    assert ended.value.code() == grpc.StatusCode.ABORTED  # CANCELLED would say the caller cancelled
    assert "took none of its stream for 0.5 s" in ended.value.details()
    telemetry.shutdown()


async def test_a_caller_stalled_on_its_last_message_gets_its_whole_answer_counted_finished(monkeypatch) -> None:
    """The request was done: ended for the stall, it ends as finished, and the caller reading again gets every
    token and an OK (it got CANCELLED after the whole answer, which clients raise on)."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    telemetry = Telemetry("test-router")
    async with stalled_caller(TwoBigMessages(), telemetry) as (_, lifecycle, (call, first)):
        assert lifecycle.in_flight == 0
        assert requests_by_outcome(telemetry) == {("finished", "anonymous"): 1}
        tokens = len(first.token_ids)
        while (msg := await call.read()) is not grpc.aio.EOF:
            tokens += len(msg.token_ids)
        assert await call.code() == grpc.StatusCode.OK and tokens == 40_000
    telemetry.shutdown()


class ManyBigMessages(worker_pb2_grpc.DecodeWorkerServicer):
    """Far more than the caller's small window holds: the router's write of one of them blocks."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        for _ in range(100):
            yield pb.GenerateResponse(token_ids=[5] * 20_000)
        yield pb.GenerateResponse(token_ids=[5], finish_reason=pb.FINISH_REASON_LENGTH)


async def test_a_caller_leaving_while_its_write_is_blocked_logs_no_error_and_counts_cancelled(monkeypatch, caplog):
    """gRPC left such a handler to the garbage collector, and it and OpenTelemetry's server interceptor (since
    replaced by rpc/server_spans.py) each logged an ERROR with a traceback for what is an ordinary cancel (and the
    lifecycle a warning, for marking the request's span after the interceptor had ended it)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdserve.log_setup import quiet_caller_left_errors

    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    quiet_caller_left_errors()
    telemetry = Telemetry("test-router", SimpleSpanProcessor(InMemorySpanExporter()))
    async with serving(ManyBigMessages()) as d0:
        lifecycle = Router([worker("p0"), worker("d0", "decode", address=d0)]).lifecycle(telemetry=telemetry)
        server = Server("127.0.0.1", 0, interceptors=telemetry.server_interceptors())
        server.add(lambda s: generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(lifecycle), s), [])
        await server.start()
        request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=4000))
        try:
            for _ in range(3):
                async with grpc.aio.insecure_channel(server.address, options=SMALL_WINDOW) as ch:
                    call = generate_pb2_grpc.GenerationStub(ch).Generate(request)
                    await call.read()
                    await asyncio.sleep(0.3)  # the router's write is blocked on the window
                    call.cancel()
                for _ in range(50):
                    if lifecycle.in_flight == 0:
                        break
                    await asyncio.sleep(0.02)
        finally:
            await server.stop(None)
    assert requests_by_outcome(telemetry) == {("cancelled", "anonymous"): 3}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    telemetry.shutdown()
