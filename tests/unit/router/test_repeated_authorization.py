"""Ambiguous credentials are refused on both front ends (a real in-process router on loopback for gRPC, its HTTP app
over ASGI): two `authorization` values, in either order, are UNAUTHENTICATED / 401 "authorization given 2 times",
where the gRPC servicer took the last one (`[Bearer nope, Bearer KEY]` was served) and the Admin check the first. A
value without the Bearer scheme says so, not that the cluster requires a key."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx2
import pytest

from pdserve.security.api_keys import KeyTable, Tenant, digest
from pdserve.v1 import admin_pb2 as apb
from pdserve.v1 import admin_pb2_grpc, generate_pb2_grpc
from pdserve.v1 import generate_pb2 as pb
from services.router.http.app import openai_app
from services.router.server import RouterServer
from tests.unit.router.router_builder import MODEL, Router
from tests.unit.router.test_admin_scopes import _router

pytestmark = pytest.mark.timeout(60)
KEY = "the-real-key"
TWICE = "authorization given 2 times; send one `authorization: Bearer KEY`"
NO_SCHEME = "authorization lacks the Bearer scheme: send `authorization: Bearer KEY`"
REPEATS = [
    (("authorization", "Bearer nope"), ("authorization", f"Bearer {KEY}")),
    (("authorization", f"Bearer {KEY}"), ("authorization", "Bearer nope")),
    (("authorization", f"Bearer {KEY}"), ("authorization", f"Bearer {KEY}")),
]


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[RouterServer]:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[keys]]\nname = "k"\nsha256 = "{digest(KEY)}"\ntenant = "t"\nadmin = true\n')
    server = await _router(keys)
    yield server
    await server.stop(None)


async def grpc_calls(address: str, metadata: tuple[tuple[str, str], ...]) -> list[tuple[grpc.StatusCode, str]]:
    """Generate's and an Admin call's answers."""
    answers = []
    async with grpc.aio.insecure_channel(address) as ch:
        request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))
        calls = (
            lambda: _drain(generate_pb2_grpc.GenerationStub(ch).Generate(request, metadata=metadata, timeout=10)),
            lambda: admin_pb2_grpc.AdminStub(ch).ClusterStatus(apb.ClusterStatusRequest(), metadata=metadata),
        )
        for call in calls:
            try:
                await call()
                answers.append((grpc.StatusCode.OK, ""))
            except grpc.aio.AioRpcError as e:
                answers.append((e.code(), e.details() or ""))
    return answers


async def _drain(stream: AsyncIterator[object]) -> None:
    async for _ in stream:
        pass


@pytest.mark.parametrize("metadata", REPEATS)
async def test_two_authorization_values_are_refused_over_grpc(router, metadata) -> None:
    assert await grpc_calls(router.address, metadata) == [(grpc.StatusCode.UNAUTHENTICATED, TWICE)] * 2


async def test_one_key_is_served_and_one_without_the_scheme_is_told_so_over_grpc(router) -> None:
    (generate, status) = await grpc_calls(router.address, (("authorization", f"Bearer {KEY}"),))
    assert generate[0] == grpc.StatusCode.UNAVAILABLE and status[0] == grpc.StatusCode.OK  # let in; no workers
    assert (
        await grpc_calls(router.address, (("authorization", KEY),))
        == [(grpc.StatusCode.UNAUTHENTICATED, NO_SCHEME)] * 2
    )


@pytest.mark.parametrize("headers", [*REPEATS, (("authorization", f"Basic {KEY}"),)])
async def test_the_http_api_refuses_them_too(headers) -> None:
    lifecycle = Router([], no_workers_wait_s=0.1).lifecycle(KeyTable({digest(KEY): Tenant("t", "k")}))
    transport = httpx2.ASGITransport(app=openai_app(lifecycle), raise_app_exceptions=False)
    body = f'{{"model": "{MODEL}", "prompt": "x", "max_tokens": 2}}'.encode()
    async with httpx2.AsyncClient(transport=transport, base_url="http://router") as http:
        r = await http.post("/v1/completions", content=body, headers=[("content-type", "application/json"), *headers])
    assert r.status_code == 401, r.text
    assert r.json()["error"]["message"] == (TWICE if len(headers) == 2 else NO_SCHEME)
