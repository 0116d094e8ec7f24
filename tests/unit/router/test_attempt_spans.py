"""Each decode attempt's client span ends with the attempt, on a real lifecycle against stand-in decode workers on
real gRPC servers, with the garbage collector off: a moved stream's second attempt ends its span when it ends (it
stops reading at its last message) or when the caller closes the stream. Before, the span stayed open, and out of
the trace, until a garbage collection found the tracing interceptor's generator."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from services.router.generation import generate
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving
from tests.unit.router.test_moved_to_a_full_worker import DiesAfter

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def exporter(monkeypatch) -> Iterator[InMemorySpanExporter]:
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    gc.disable()
    try:
        yield InMemorySpanExporter()
    finally:
        gc.enable()


def moved_stream(
    exporter: InMemorySpanExporter, d0: str, d1: str, max_tokens: int
) -> AsyncIterator[pb.GenerateResponse]:
    """A stream that d0 fails after two tokens and d1 continues."""

    async def admitted(ticket: Ticket) -> None:
        pass

    decode = [worker("d0", "decode", address=d0), worker("d1", "decode", address=d1, kv_blocks_free=2048)]
    lifecycle = Router([worker("p0"), *decode]).lifecycle(telemetry=Telemetry("r", SimpleSpanProcessor(exporter)))
    request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=max_tokens))
    return generate(lifecycle, request, {}, lambda: 10.0, admitted)


def attempts(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    # the client spans of the router's calls (opentelemetry-instrumentation-grpc names them with the slash)
    return [s for s in exporter.get_finished_spans() if s.name == "/pdserve.v1.DecodeWorker/Generate"]


async def test_a_moved_stream_ends_both_attempts_spans_by_its_last_message(exporter):
    async with serving(DiesAfter(sent=2)) as d0, serving(StandInDecode()) as d1:
        stream = moved_stream(exporter, d0, d1, max_tokens=6)
        got = [msg async for msg in stream]
    assert got[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert [s.attributes["rpc.grpc.status_code"] for s in attempts(exporter)] == [14, 0]  # UNAVAILABLE, then OK


async def test_a_moved_stream_the_caller_closes_ends_the_second_attempts_span(exporter):
    async with serving(DiesAfter(sent=2)) as d0, serving(StandInDecode(gap_s=0.2)) as d1:
        stream = moved_stream(exporter, d0, d1, max_tokens=40)
        for _ in range(3):  # two from d0, the third from d1 after the move
            await anext(stream)
        assert len(attempts(exporter)) == 1
        await stream.aclose()
        assert len(attempts(exporter)) == 2


async def test_the_request_span_names_the_workers_that_served_it_after_a_move(exporter):
    """The `retry`/`migration` event names the failed worker; the span's own ids name the ones it ended on (they
    named the first placement, d0, for a request d1 answered)."""
    telemetry = Telemetry("r", SimpleSpanProcessor(exporter))
    async with serving(DiesAfter(sent=2)) as d0, serving(StandInDecode()) as d1:
        with telemetry.tracer.start_as_current_span("request"):
            stream = moved_stream(exporter, d0, d1, max_tokens=6)
            assert [msg async for msg in stream][-1].finish_reason == pb.FINISH_REASON_LENGTH
    (request,) = [s for s in exporter.get_finished_spans() if s.name == "request"]
    assert [(e.name, e.attributes["failed.worker.id"]) for e in request.events] == [("migration", "d0")]
    assert request.attributes["decode.worker.id"] == "d1" and request.attributes["attempts"] == 2
