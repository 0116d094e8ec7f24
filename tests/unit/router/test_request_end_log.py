"""A request the caller's own deadline ended is logged at INFO, not as a failure of the cluster's (WARNING), and
counted as `deadline_exceeded`: an SRE alerting on the router's warnings or failed requests must not be paged by
clients with short deadlines. A request its key's quota refused is logged and traced under the id its caller gave.
Through a real lifecycle against stand-in decode workers on real gRPC servers."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.errors import OverloadedError
from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from services.router.generation import generate
from services.router.ticket import Ticket
from tests.unit.router.json_lines import JsonLines
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)


async def _run(time_left_s: float, telemetry: Telemetry) -> BaseException | None:
    async def admitted(ticket: Ticket) -> None:
        pass

    async with serving(StandInDecode(gap_s=0.5)) as d0:
        lc = Router([worker("p0"), worker("d0", "decode", address=d0)]).lifecycle(telemetry=telemetry)
        request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=8))
        try:
            async for _ in generate(lc, request, {}, lambda: time_left_s, admitted):
                pass
        except Exception as e:
            return e
    return None


def test_a_callers_deadline_is_logged_at_info_and_names_no_address(monkeypatch, caplog):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    caplog.set_level(logging.INFO, logger="services.router.lifecycle")
    telemetry = Telemetry("test-router")
    error = asyncio.run(_run(0.3, telemetry))
    assert isinstance(error, TimeoutError), error
    assert requests_by_outcome(telemetry) == {("deadline_exceeded", "anonymous"): 1}
    telemetry.shutdown()
    ended = [r for r in caplog.records if r.name == "services.router.lifecycle" and "Deadline" in r.getMessage()]
    assert ended and all(r.levelno == logging.INFO for r in ended), [(r.levelname, r.getMessage()) for r in ended]
    assert "127.0.0.1" not in str(error)  # the caller is told the worker's id, not its address


async def admitted(ticket: Ticket) -> None:
    pass


def test_a_request_its_keys_max_concurrent_refuses_is_logged_and_traced_under_its_callers_id(monkeypatch):
    """Refused after its message was parsed: its log line has its request_id (not null), its span the ids and the
    `refused` answer, as an admission shed's have."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    exporter = InMemorySpanExporter()
    telemetry = Telemetry("test-router", span_processor=SimpleSpanProcessor(exporter))
    lines, logger = JsonLines(), logging.getLogger("services.router.lifecycle")
    logger.addHandler(lines)
    monkeypatch.setattr(logger, "level", logging.INFO)
    key = {"authorization": "Bearer k1"}

    def request(request_id: str) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=50)
        )

    async def run() -> None:
        async with serving(StandInDecode(gap_s=0.02)) as d0:
            keys = KeyTable({digest("k1"): Tenant("team", "k", max_concurrent=1)})
            lc = Router([worker("p0"), worker("d0", "decode", address=d0)]).lifecycle(keys, telemetry=telemetry)
            streaming, done = asyncio.Event(), asyncio.Event()

            async def holds_the_keys_stream() -> None:
                async with aclosing(generate(lc, request("holds-the-stream"), key, lambda: 10.0, admitted)) as s:
                    await anext(s)
                    streaming.set()
                    await done.wait()

            holding = asyncio.ensure_future(holds_the_keys_stream())
            await streaming.wait()
            with telemetry.tracer.start_as_current_span("call"), pytest.raises(OverloadedError, match="max_concurrent"):
                async for _ in generate(lc, request("over-its-streams"), key, lambda: 10.0, admitted):
                    pass
            done.set()
            await holding

    try:
        asyncio.run(run())
    finally:
        logger.removeHandler(lines)
    (call,) = [s for s in exporter.get_finished_spans() if s.name == "call"]
    assert call.attributes["request.client_id"] == "over-its-streams", dict(call.attributes)
    assert "max_concurrent" in str(call.attributes.get("refused")), dict(call.attributes)
    ended = [line for line in lines.lines if line.get("outcome") == "rejected"]
    assert [line["request_id"] for line in ended] == ["over-its-streams"], lines.lines
    telemetry.shutdown()
