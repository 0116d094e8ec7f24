"""A streaming HTTP caller that hangs up while the router's write to it waits (a slow reader, its window full):
the cancel lands in the response's `send`, outside the events, and everything the request holds must still end in
its own task, at once: the decode call, the ticket, the span (marked cancelled), the accounting. Before, all of it
waited, suspended, for a garbage collection in another task."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.telemetry import Telemetry
from services.router.http.app import openai_app
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import MODEL, Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)


async def test_a_caller_that_hangs_up_during_a_write_ends_everything_at_once(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("test-router", span_processor=SimpleSpanProcessor(exporter))
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 200, "stream": True, "ignore_eos": True}
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    gone, bodies = asyncio.Event(), []

    async def receive() -> dict:
        if request:
            return request.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            bodies.append(message)
            if len(bodies) == 3:  # the caller's window is full: the write waits, and the caller hangs up
                gone.set()
                await asyncio.sleep(3600)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
        "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json")], "scheme": "http", "server": ("r", 80), "client": ("c", 1),
    }  # fmt: skip
    decode = StandInDecode(gap_s=0.02)
    gc.disable()  # what is left to the collector stays left
    try:
        async with serving(decode) as address:
            lifecycle = Router([worker("p0"), worker("d0", "decode", address=address)]).lifecycle(telemetry=telemetry)
            await asyncio.wait_for(openai_app(lifecycle)(scope, receive, send), 10)
            await asyncio.sleep(0.2)
            (span,) = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions"]
            assert span.attributes["cancelled"] is True
            assert lifecycle.in_flight == 0
            assert not lifecycle.tracker.decoding["d0"]  # the decode call was cancelled
            assert requests_by_outcome(telemetry) == {("cancelled", "anonymous"): 1}
    finally:
        gc.enable()
        telemetry.shutdown()
