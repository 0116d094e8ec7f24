"""The router's Generation service is NOT_SERVING while placement has no live prefill and decode worker, its
server's health ("", which the chart's probes ask) SERVING throughout: asked over real gRPC health of a router
whose registry the test fills and empties."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.config import RouterConfig
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.telemetry import Telemetry
from services.router.server import GENERATION_SERVICE, start_router
from tests.unit.router.router_builder import worker

pytestmark = pytest.mark.timeout(60)
SERVING, NOT_SERVING = "SERVING", "NOT_SERVING"


async def health(address: str, service: str) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def until(address: str, status: str) -> None:
    """Waits for the Generation service to report `status`; the router looks every second."""
    for _ in range(100):
        if await health(address, GENERATION_SERVICE) == status:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{GENERATION_SERVICE} never {status}")


async def test_generation_follows_the_live_workers_while_the_server_stays_serving():
    registry = InMemoryRegistry()
    telemetry = Telemetry("pdserve-router", enabled=False)
    args = ("tiny-random", registry, InMemoryPrefixIndex(), RouterConfig(), "127.0.0.1", 0, telemetry)
    server, _ = await start_router(*args)
    try:
        address = server.address
        assert await health(address, GENERATION_SERVICE) == NOT_SERVING  # no worker at all, from its start
        assert await health(address, "") == SERVING
        registry.publish(worker("p0", "prefill"))
        await asyncio.sleep(1.5)
        assert await health(address, GENERATION_SERVICE) == NOT_SERVING  # a prefill worker alone serves nothing
        decode = worker("d0", "decode")
        registry.publish(decode)
        await until(address, SERVING)
        registry.publish(dataclasses.replace(decode, draining=True))  # the only decode worker leaves placement
        await until(address, NOT_SERVING)
        assert await health(address, "") == SERVING
        registry.remove("p0")
        registry.remove("d0")
        registry.publish(worker("c0", "colocated"))  # one colocated worker serves both roles
        await until(address, SERVING)
    finally:
        await server.stop(None)
