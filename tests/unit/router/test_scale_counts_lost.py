"""A live scale whose registry lost its desired counts between the scale's read and its write (a Redis restarted
empty just then), through a real in-process router's Admin service over gRPC: a scale of one role is refused with
a retry hint rather than leaving that role's count alone in the registry (the fleet writes its counts back only
where there are none, so it would never mend it); a scale giving every role writes them all."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.config import RouterConfig
from pdserve.protocol.roles import Role
from pdserve.registry.base import WorkerState
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.telemetry import Telemetry
from pdserve.v1 import admin_pb2 as apb
from pdserve.v1 import admin_pb2_grpc
from services.router.server import RouterServer, start_router

pytestmark = pytest.mark.timeout(60)


class LosesCountsAfterARead(InMemoryRegistry):
    """Its desired counts are gone right after the first read of them, as a Redis restarted empty then."""

    def desired_counts(self) -> dict[Role, int]:
        counts = super().desired_counts()
        if counts:
            self.set_desired_counts({})
        return counts


@pytest.fixture
async def router() -> AsyncIterator[tuple[RouterServer, LosesCountsAfterARead]]:
    registry = LosesCountsAfterARead()
    for worker_id, role in (("p0", Role.PREFILL), ("d0", Role.DECODE)):
        registry.publish(WorkerState(worker_id, role, f"{worker_id}:1"))
    registry.set_desired_counts({Role.PREFILL: 1, Role.DECODE: 1})
    config = RouterConfig(no_workers_wait_s=0.1)
    server, _ = await start_router(
        "tiny-random", registry, InMemoryPrefixIndex(), config, "127.0.0.1", 0, Telemetry("t", enabled=False)
    )
    yield server, registry
    await server.stop(None)


async def scale(address: str, **counts: int) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            await admin_pb2_grpc.AdminStub(ch).ScaleWorkers(apb.ScaleWorkersRequest(**counts), timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def test_a_scale_of_one_role_onto_counts_lost_meanwhile_is_retried_not_half_written(router) -> None:
    server, registry = router
    assert await scale(server.address, prefill=3) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert registry.desired_counts() == {}  # nothing written: the fleet writes its counts back


async def test_a_scale_of_every_role_onto_counts_lost_meanwhile_writes_them_all(router) -> None:
    server, registry = router
    assert await scale(server.address, prefill=3, decode=2) == grpc.StatusCode.OK
    assert InMemoryRegistry.desired_counts(registry) == {Role.PREFILL: 3, Role.DECODE: 2}
