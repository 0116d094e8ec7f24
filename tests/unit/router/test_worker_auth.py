"""A decode worker on another cluster secret than the router's (a rotation not yet everywhere) refuses its calls
with UNAUTHENTICATED. Through the shared request path of a real lifecycle, against stand-in decode workers on real
gRPC servers: that worker is the cluster's fault, as a dead one is (the request moves, the worker is ejected, the
detail is logged), and the client is never told UNAUTHENTICATED nor where the worker is."""

from __future__ import annotations

import logging
import time

import pytest

from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.errors import UnavailableError
from pdserve.v1 import generate_pb2 as pb
from services.router.generation import generate
from services.router.http.errors import error_body
from services.router.lifecycle import RequestLifecycle
from services.router.ticket import Ticket
from tests.unit.router.router_builder import Router, worker
from tests.unit.router.stand_in_decode import StandInDecode, serving

pytestmark = pytest.mark.timeout(60)
REQUEST = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(max_tokens=4))


async def tokens(lc: RequestLifecycle) -> list[int]:
    async def admitted(ticket: Ticket) -> None:
        pass

    out: list[int] = []
    async for msg in generate(lc, REQUEST, {}, lambda: 10.0, admitted):
        out.extend(msg.token_ids)
    return out


async def test_a_worker_refusing_the_routers_credentials_is_ejected_and_the_request_moves(monkeypatch, caplog):
    monkeypatch.setenv(CLUSTER_SECRET_VAR, "current")
    stale, current = StandInDecode(), StandInDecode()
    async with serving(stale, b"rotated") as stale_at, serving(current, b"current") as current_at:
        # The stale worker has the more free blocks, so placement tries it first.
        d0, d1 = worker("d0", "decode", address=stale_at), worker("d1", "decode", address=current_at, kv_blocks_free=64)
        router = Router([worker("p0"), d0, d1])
        with caplog.at_level(logging.WARNING):
            assert len(await tokens(router.lifecycle())) == 4
    assert (stale.calls, current.calls) == (0, 1)  # refused before its handler; served by the other
    assert router.placement.ejections.ejected(d0) and not router.placement.ejections.ejected(d1)
    ejected = [r.getMessage() for r in caplog.records if "out of placement" in r.getMessage()]
    assert len(ejected) == 1 and stale_at in ejected[0] and "UNAUTHENTICATED" in ejected[0]


async def test_with_no_other_worker_the_client_gets_unavailable_without_the_detail(monkeypatch, caplog):
    monkeypatch.setenv(CLUSTER_SECRET_VAR, "current")
    async with serving(StandInDecode(), b"rotated") as stale_at:
        router = Router([worker("p0"), worker("d0", "decode", address=stale_at)])
        start = time.monotonic()
        with caplog.at_level(logging.WARNING), pytest.raises(UnavailableError) as caught:
            await tokens(router.lifecycle())
    assert time.monotonic() - start < 10
    status, body, _ = error_body(caught.value)
    assert (status, body["error"]["type"]) == (503, "service_unavailable_error")
    message = body["error"]["message"]
    assert "cluster credentials" in message and stale_at not in message and "not a cluster peer" not in message
    assert any(stale_at in r.getMessage() and "UNAUTHENTICATED" in r.getMessage() for r in caplog.records)
