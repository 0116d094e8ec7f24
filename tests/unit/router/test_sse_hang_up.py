"""A streaming HTTP caller that hangs up while the router's write to it waits (a slow reader, its window full):
the cancel lands in the response's `send`, outside the events, and everything the request holds must still end in
its own task, at once: the decode call, the ticket, the span (marked cancelled), the accounting. Before, all of it
waited, suspended, for a garbage collection in another task."""

from __future__ import annotations

import asyncio
import gc

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.telemetry import Telemetry
from services.router.http.app import openai_app
from tests.unit.router.asgi_caller import HangingUpCaller
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import MODEL, Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)


async def test_a_caller_that_hangs_up_during_a_write_ends_everything_at_once(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("test-router", span_processor=SimpleSpanProcessor(exporter))
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 200, "stream": True, "ignore_eos": True}
    caller, bodies = HangingUpCaller(body), []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message)
            if len(bodies) == 3:  # the caller's window is full: the write waits, and the caller hangs up
                caller.gone.set()
                await asyncio.sleep(3600)

    decode = StandInDecode(gap_s=0.02)
    gc.disable()  # what is left to the collector stays left
    try:
        async with serving(decode) as address:
            lifecycle = Router([worker("p0"), worker("d0", "decode", address=address)]).lifecycle(telemetry=telemetry)
            await asyncio.wait_for(openai_app(lifecycle)(caller.scope, caller.receive, send), 10)
            await asyncio.sleep(0.2)
            (span,) = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions"]
            assert span.attributes["cancelled"] is True
            assert lifecycle.in_flight == 0
            assert not lifecycle.tracker.decoding["d0"]  # the decode call was cancelled
            assert requests_by_outcome(telemetry) == {("cancelled", "anonymous"): 1}
    finally:
        gc.enable()
        telemetry.shutdown()
