"""A placed worker the registry drops before the first token (the supervisor found it stuck, or its heartbeats
stopped) while another of its role serves: the router cancels that attempt at once and places the request again,
where it waited for gRPC keepalive (about 15 s) or the first-token bound (60 s). A draining worker stays listed and
keeps its request, as does the last of its role; a registry view kept through an outage cuts nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.registry.memory import InMemoryRegistry
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.router.generation import generate
from services.router.ticket import Ticket
from tests.unit.router.request_counts import ejections_by_reason
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
STUCK = "p0.local:50051"  # the prefill worker whose prompts the decode stand-in gets no KV from for a while
HOLD_S = 1.5


class WaitsOnStuckPrefill(StandInDecode):
    """Sends nothing for HOLD_S on a request placed with the stuck prefill worker (its hand-off hangs), at once
    otherwise; records each call's prefill address."""

    def __init__(self) -> None:
        super().__init__()
        self.prefills: list[str] = []

    async def Generate(  # noqa: N802
        self, request: wpb.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.prefills.append(request.prefill_address)
        if request.prefill_address == STUCK:
            await asyncio.sleep(HOLD_S)
        async for msg in super().Generate(request, context):
            yield msg


class OutageView(InMemoryRegistry):
    """A registry whose view is one kept through an outage: who is missing from it says nothing."""

    def view_current(self) -> bool:
        return False


async def run_while(change: str, registry: InMemoryRegistry | None = None) -> tuple[list[str], float, Telemetry]:
    """One request placed on p0 (the only prefill worker listed), `change` made to the registry once its decode call
    began (p0 `removed` with p1 listed, `removed alone`, or p0 `draining`); the prefill addresses its decode calls
    named, its time."""
    decode = WaitsOnStuckPrefill()
    async with serving(decode) as d0:
        router = Router([worker("p0"), worker("d0", "decode", address=d0)], registry=registry)
        telemetry = Telemetry("test-router")
        lifecycle = router.lifecycle(telemetry=telemetry)
        request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=4))

        async def admitted(ticket: Ticket) -> None:
            pass

        async def consume() -> list[int]:
            return [t async for m in generate(lifecycle, request, {}, lambda: None, admitted) for t in m.token_ids]

        started = time.monotonic()
        task = asyncio.ensure_future(consume())
        while not decode.prefills:  # placed: a fixed sleep may end before the call on a loaded host
            assert not task.done() and time.monotonic() - started < 10, task
            await asyncio.sleep(0.01)
        assert decode.prefills == [STUCK]
        if change.startswith("removed"):
            if change == "removed":
                router.registry.publish(worker("p1"))
            router.registry.remove("p0")
        else:
            router.registry.publish(worker("p0", draining=True))
        assert len(await task) == 4
        return decode.prefills, time.monotonic() - started, telemetry


async def test_a_prefill_worker_unlisted_before_the_first_token_loses_the_request_to_another_at_once(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    prefills, took, telemetry = await run_while("removed")
    assert prefills == [STUCK, "p1.local:50051"]
    assert took < HOLD_S  # moved within a check of the registry, not after the stuck worker's hold
    assert ejections_by_reason(telemetry) == {("p0", "unlisted"): 1}  # blamed on the prefill worker, not the decode one


async def test_a_draining_prefill_worker_keeps_the_request_it_holds(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    prefills, took, telemetry = await run_while("draining")
    assert prefills == [STUCK] and took >= HOLD_S
    assert ejections_by_reason(telemetry) == {}


async def test_a_view_kept_through_a_registry_outage_cuts_nothing(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    prefills, took, _ = await run_while("removed", OutageView(ttl_s=600))
    assert prefills == [STUCK] and took >= HOLD_S


async def test_the_last_prefill_worker_unlisted_keeps_the_request_it_holds(monkeypatch):
    """With no other prefill worker the request has nowhere to go, and a worker starved of CPU past the registry's
    TTL reads as one stuck: it waits there, as before (the first-token bound covers one truly stuck)."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    prefills, took, telemetry = await run_while("removed alone")
    assert prefills == [STUCK] and took >= HOLD_S
    assert ejections_by_reason(telemetry) == {}
