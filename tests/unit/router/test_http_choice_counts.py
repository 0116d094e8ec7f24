"""How the HTTP API's `n` choices are counted in `pdserve_requests_total`, through the real ASGI app and lifecycle
against a stand-in decode worker: each choice once, however the request ended, so the outcomes add up to `n`."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.telemetry import Telemetry
from services.router.http.app import openai_app
from tests.unit.router.asgi_caller import HangingUpCaller
from tests.unit.router.request_counts import requests_by_outcome
from tests.unit.router.router_builder import MODEL, Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)


class LaterChoicesSlow(StandInDecode):
    """The first call's first token comes at once, every later call's after 1 s."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        if self.calls:
            await asyncio.sleep(1.0)
        async for msg in super().Generate(request, context):
            yield msg


class LaterChoicesRefused(StandInDecode):
    """Every call after the first is refused as a request no retry can mend."""

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        if self.calls:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a refusal of the second choice")
        async for msg in super().Generate(request, context):
            yield msg


async def choices_counted(hang_up: bool, decode: StandInDecode | None = None) -> dict[tuple[str, str], float]:
    """Runs one streamed n=4 request (the caller hanging up at its first event when `hang_up`); its counts."""
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "n": 4, "stream": True, "ignore_eos": True}
    caller = HangingUpCaller(body)

    async def send(message: dict) -> None:
        if hang_up and message["type"] == "http.response.body" and message.get("body", b"").startswith(b"data: {"):
            caller.gone.set()

    telemetry = Telemetry("test-router")
    async with serving(decode or LaterChoicesSlow(gap_s=0.3)) as address:
        lifecycle = Router([worker("p0"), worker("d0", "decode", address=address)]).lifecycle(telemetry=telemetry)
        await asyncio.wait_for(openai_app(lifecycle)(caller.scope, caller.receive, send), 20)
        assert lifecycle.in_flight == 0
    counted = requests_by_outcome(telemetry)
    telemetry.shutdown()
    return counted


async def test_choices_that_never_started_count_as_cancelled_when_the_caller_hangs_up(monkeypatch):
    """The caller leaves at choice 0's first token: choice 1 is waiting for its own, 2-3 never started. All four
    are the caller's cancels (before, two: those that never started were counted only when a sibling failed)."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    assert await choices_counted(hang_up=True) == {("cancelled", "anonymous"): 4}


async def test_a_request_whose_choices_all_finish_counts_each_once(monkeypatch):
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    assert await choices_counted(hang_up=False) == {("finished", "anonymous"): 4}


async def test_choices_a_refused_sibling_ended_count_as_it_ended(monkeypatch):
    """Choice 1 refused INVALID_ARGUMENT by its decode worker ends the others: each counts as that refusal (the
    first failure, which the request's span also says it was refused for), not as the caller's cancel."""
    monkeypatch.delenv(CLUSTER_SECRET_VAR, raising=False)
    assert await choices_counted(hang_up=False, decode=LaterChoicesRefused(gap_s=0.3)) == {("invalid", "anonymous"): 4}
