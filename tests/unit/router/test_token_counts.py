"""The router's token counters and finish reasons through a real lifecycle against stand-in decode workers on real
gRPC servers: what the caller was served, counted once per request however many attempts it took."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from services.router.generation import generate
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving
from tests.unit.router.test_moved_to_a_full_worker import DiesAfter

pytestmark = pytest.mark.timeout(60)
PROMPT = [5, 6, 7, 8]


def samples(telemetry: Telemetry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Labels (sorted, the exporter's otel_scope_* left out) -> value of every sample of `name` past 0 (a counter's
    series of a known tenant start at 0)."""
    return {
        tuple(sorted((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope_"))): s.value
        for f in telemetry.registry.collect()
        for s in f.samples
        if s.name == name and s.value
    }


def stream(telemetry: Telemetry, d0: str, d1: str, max_tokens: int) -> AsyncIterator[pb.GenerateResponse]:
    async def admitted(ticket: Ticket) -> None:
        pass

    decode = [worker("d0", "decode", address=d0), worker("d1", "decode", address=d1, kv_blocks_free=2048)]
    lifecycle = Router([worker("p0"), *decode]).lifecycle(telemetry=telemetry)
    request = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=pb.SamplingParams(max_tokens=max_tokens))
    return generate(lifecycle, request, {}, lambda: 10.0, admitted)


async def test_a_migrated_request_counts_its_prompt_once_and_every_token_it_was_served(monkeypatch):
    """d0 fails after two tokens and d1 continues from a prompt of six (the four, then the two streamed): the
    caller was served its four prompt tokens and six tokens, and the request finished once, for its length."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    telemetry = Telemetry("test-router")
    async with serving(DiesAfter(sent=2)) as d0, serving(StandInDecode()) as d1:
        got = [t async for msg in stream(telemetry, d0, d1, max_tokens=6) for t in msg.token_ids]
    assert len(got) == 6
    tenant = (("tenant", "anonymous"),)
    assert samples(telemetry, "pdserve_prompt_tokens_total") == {tenant: 4}
    assert samples(telemetry, "pdserve_generation_tokens_total") == {tenant: 6}
    assert samples(telemetry, "pdserve_request_success_total") == {(("finish_reason", "length"), *tenant): 1}
    assert samples(telemetry, "pdserve_requests_total") == {(("outcome", "finished"), *tenant): 1}
    telemetry.shutdown()


async def test_a_stream_its_caller_leaves_counts_the_tokens_it_got_and_no_success(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    telemetry = Telemetry("test-router")
    async with serving(StandInDecode(gap_s=0.05)) as d0, serving(StandInDecode()) as d1:
        messages = stream(telemetry, d0, d1, max_tokens=40)
        for _ in range(3):
            await anext(messages)
        await messages.aclose()
    tenant = (("tenant", "anonymous"),)
    assert samples(telemetry, "pdserve_prompt_tokens_total") == {tenant: 4}
    assert samples(telemetry, "pdserve_generation_tokens_total") == {tenant: 3}
    assert samples(telemetry, "pdserve_request_success_total") == {}
    assert samples(telemetry, "pdserve_requests_total") == {(("outcome", "cancelled"), *tenant): 1}
    telemetry.shutdown()
