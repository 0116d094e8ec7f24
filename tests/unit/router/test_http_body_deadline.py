"""The HTTP API's deadline on a request's body: a client that sends its head and then the body a byte at a time
gets a 408 and its connection closed, as a slow head is cut (connection_deadlines); the router serves on. Real
uvicorn on loopback, the real ASGI app and lifecycle."""

from __future__ import annotations

import httpx2
import pytest

from pdserve.telemetry import Telemetry
from services.router.http import app as http_app
from services.router.http.app import openai_app
from services.router.http.server import HttpServer
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.slow_client import dribbled

DEADLINE_S = 0.5
pytestmark = pytest.mark.timeout(60)


async def test_a_body_sent_a_byte_at_a_time_is_a_408_at_its_deadline(monkeypatch):
    monkeypatch.setattr(http_app, "BODY_TIMEOUT_S", DEADLINE_S)
    lifecycle = Router([worker("p0"), worker("d0", "decode")]).lifecycle(telemetry=Telemetry("test-router"))
    server = HttpServer(openai_app(lifecycle), "127.0.0.1", 0)
    await server.start()
    try:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        start = head + b"Content-Length: 1000\r\n\r\n{"
        answer, closed_after = await dribbled(server.port, start, b" ", 10 * DEADLINE_S)
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=5) as http:
            assert (await http.get("/health")).status_code in (200, 503)  # still serving
    finally:
        await server.stop()
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout", answer
    assert b"connection: close" in rest.lower() and b"did not arrive within 0.5 s" in rest, answer
    assert DEADLINE_S * 0.8 <= closed_after < 6 * DEADLINE_S, closed_after
    counted = {
        s.labels["outcome"]: s.value
        for f in lifecycle.telemetry.registry.collect()
        for s in f.samples
        if s.name == "pdserve_requests_total" and s.value  # every outcome starts at 0
    }
    lifecycle.telemetry.shutdown()
    assert counted == {"invalid": 1}  # the caller's doing, not a caller that left (cancelled)
