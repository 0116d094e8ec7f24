"""A streaming call ended before its last message, through OpenTelemetry's client interceptor on a real loopback
server: its span ends when the call is ended, not when a garbage collection finds the interceptor's generator,
and a task cancelled meanwhile still ends cancelled. The garbage collector is off, so nothing ends by it."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.rpc.channel_pool import ChannelPool
from pdserve.rpc.stream_end import cancel_stream
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def traced(monkeypatch) -> AsyncIterator[tuple[Callable[..., grpc.aio.UnaryStreamCall], InMemorySpanExporter]]:
    """Starts slow streams (1000 tokens unless told) through a traced channel; the spans ended so far."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("t", span_processor=SimpleSpanProcessor(exporter))
    pool = ChannelPool(worker_pb2_grpc.DecodeWorkerStub, telemetry.client_interceptors())
    gc.disable()
    try:
        async with serving(StandInDecode(gap_s=0.05)) as address:

            def start(max_tokens: int = 1000) -> grpc.aio.UnaryStreamCall:
                request = wpb.WorkerGenerateRequest(request_id="r", sampling=pb.SamplingParams(max_tokens=max_tokens))
                return pool.call(address, lambda stub: stub.Generate(request))

            yield start, exporter
            await pool.close()
    finally:
        gc.enable()
        telemetry.shutdown()


async def test_a_stream_ended_midway_ends_its_span_at_once(traced):
    start, exporter = traced
    call = start()
    for _ in range(2):
        assert (await call.read()).token_ids
    assert not exporter.get_finished_spans()
    await cancel_stream(call)
    assert call.cancelled()
    assert [s.name for s in exporter.get_finished_spans()] == ["/pdserve.v1.DecodeWorker/Generate"]
    await cancel_stream(call)  # once ended: nothing more
    assert len(exporter.get_finished_spans()) == 1


async def test_a_task_cancelled_between_reads_ends_cancelled_and_its_span_ends(traced):
    start, exporter = traced
    read = asyncio.Event()

    async def read_then_wait() -> None:
        call = start()
        try:
            await call.read()
            read.set()
            await asyncio.sleep(3600)  # cancelled here, the interceptor's generator suspended at the message read
        finally:
            await cancel_stream(call)

    task = asyncio.create_task(read_then_wait())
    await read.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert len(exporter.get_finished_spans()) == 1


async def test_a_stream_read_to_its_end_is_left_as_it_ended(traced):
    start, exporter = traced
    call = start(max_tokens=2)
    while await call.read() is not grpc.aio.EOF:
        pass
    await cancel_stream(call)
    assert await call.code() == grpc.StatusCode.OK
    (span,) = exporter.get_finished_spans()
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
