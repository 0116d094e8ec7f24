"""Two real in-process routers (gRPC and HTTP on loopback, tiny-random's tokenizer, an API-key file) on one
redis-server, as the chart's router replicas share one: a key's requests_per_second holds for the pair, whichever
router and protocol a request comes through, and a KV claim either router sets or ends does for both. No workers: a
request the quota lets in is UNAVAILABLE (503) after `no_workers_wait_s`; one over the key's rate is
RESOURCE_EXHAUSTED (429) with its retry hint."""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import AsyncIterator, Callable

import grpc
import httpx2
import pytest

from pdserve.config import RouterConfig
from pdserve.registry.redis import RedisRegistry
from pdserve.registry.redis_prefix import RedisPrefixIndex
from pdserve.telemetry import Telemetry
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc
from services.router.server import RouterServer, start_router
from tests.redis_server import started

pytestmark = pytest.mark.timeout(120)
KEY = "shared-key"
RATE = 2  # requests per second for the key, on both routers together


redis_server = pytest.fixture(scope="module")(started)


@pytest.fixture
async def two_routers(redis_server, tmp_path) -> AsyncIterator[list[RouterServer]]:
    keys = tmp_path / "keys.toml"
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    keys.write_text(
        f'[[keys]]\nname = "shared"\nsha256 = "{digest}"\ntenant = "team-a"\nrequests_per_second = {RATE}\n'
    )
    # A generous budget: this test is about the shared count, not the fallback of a slow Redis.
    config = RouterConfig(api_keys_file=str(keys), no_workers_wait_s=0.1, quota_budget_s=2.0)
    routers, registries = [], []
    try:
        for _ in range(2):
            registry, index = RedisRegistry(redis_server.url), RedisPrefixIndex(redis_server.url)
            await registry.start()
            registries.append((registry, index))
            telemetry = Telemetry("pdserve-router", enabled=False)
            server, _ = await start_router(
                "tiny-random", registry, index, config, "127.0.0.1", 0, telemetry, http_port=0
            )
            routers.append(server)
        yield routers
    finally:
        for server in routers:
            await server.stop(None)
        for registry, index in registries:
            await index.close()
            await registry.close()


async def over_grpc(address: str) -> tuple[str, int | None]:
    """The status and its retry hint in ms."""
    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))
    try:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            async for _ in stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=10):
                pass
    except grpc.aio.AioRpcError as e:
        hint = dict(e.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
        return e.code().name, int(hint) if hint is not None else None
    return "OK", None


async def over_http(http: httpx2.AsyncClient) -> tuple[str, int | None]:
    body = {"model": "tiny-random", "prompt": "hi", "max_tokens": 2}
    r = await http.post("/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
    names = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}
    hint = r.headers.get("retry-after-ms")
    return names.get(r.status_code, str(r.status_code)), int(hint) if hint is not None else None


async def test_a_keys_rate_holds_for_two_routers_together(two_routers):
    grpc_router, http_router = two_routers
    async with httpx2.AsyncClient(base_url=f"http://{http_router.http.address}", timeout=10) as http:
        start = time.monotonic()  # one burst, so little refills during it
        answers = await asyncio.gather(
            *(over_grpc(grpc_router.address) if i % 2 == 0 else over_http(http) for i in range(12))
        )
        elapsed = time.monotonic() - start
    statuses = [status for status, _ in answers]
    let_in = statuses.count("UNAVAILABLE")  # past the quota, and no worker to serve it
    assert set(statuses) <= {"UNAVAILABLE", "RESOURCE_EXHAUSTED"}, answers
    # The key's burst (one second of requests) plus what refilled meanwhile; per router it would be twice that.
    assert RATE <= let_in <= RATE + math.ceil(RATE * elapsed), (answers, elapsed)
    refused = [(i, hint) for i, (status, hint) in enumerate(answers) if status == "RESOURCE_EXHAUSTED"]
    assert {i % 2 for i, _ in refused} == {0, 1}, answers  # each router refused some: the count is shared
    assert all(hint is not None and 0 < hint <= 1000 / RATE + 1 for _, hint in refused), answers


async def test_a_kv_claim_set_or_ended_through_one_router_is_for_both(two_routers):
    """Through each router's own background task (services/router/shared_claims.py), within a few intervals."""
    a, b = (router.shared_claims.claims for router in two_routers)
    # As admission claims for a request refused past its SLO; it would lapse in 40 s, long past `until`'s bound.
    a.claim("d0", 50, retry_after_s=10.0, after_s=0.0)
    await until(lambda: b.held_from("d0", 10) == 50)
    b.admitted(50)
    await until(lambda: a.held_from("d0", 10) == 0)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not shared in time"
        await asyncio.sleep(0.05)
