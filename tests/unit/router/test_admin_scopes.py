"""What each key may call of a real in-process router's Admin service (gRPC on loopback, an API-key file, no
workers): a worker pod's drain key (`admin = ["DrainWorkers"]`) drains and neither scales nor surveys the cluster,
an `admin = true` key calls everything, and an `admin` value the router cannot read fails its start."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from pdserve.config import RouterConfig
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.security.api_keys import bearer_metadata, digest
from pdserve.telemetry import Telemetry
from pdserve.v1 import admin_pb2 as apb
from pdserve.v1 import admin_pb2_grpc, generate_pb2_grpc
from pdserve.v1 import generate_pb2 as pb
from services.router.server import RouterServer, start_router

pytestmark = pytest.mark.timeout(60)
KEYS = {  # key -> its entry's admin value
    "drain-key": '["DrainWorkers"]',
    "admin-key": "true",
    "plain-key": "false",
}
NO_WORKERS_HOST = "127.0.0.1"  # the caller's own host (a drain key drains no other), with no worker: drains none
CALLS = {
    "DrainWorkers": apb.DrainWorkersRequest(host=NO_WORKERS_HOST, timeout_s=1),
    "ScaleWorkers": apb.ScaleWorkersRequest(prefill=1, decode=1),
    "ClusterStatus": apb.ClusterStatusRequest(),
}


async def _router(keys: Path) -> RouterServer:
    config = RouterConfig(api_keys_file=str(keys), no_workers_wait_s=0.1)
    telemetry = Telemetry("pdserve-router", enabled=False)
    server, _ = await start_router(
        "tiny-random", InMemoryRegistry(), InMemoryPrefixIndex(), config, "127.0.0.1", 0, telemetry
    )
    return server


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[RouterServer]:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        "".join(
            f'[[keys]]\nname = "{k}"\nsha256 = "{digest(k)}"\ntenant = "ops"\nmax_priority = 0\nadmin = {admin}\n'
            for k, admin in KEYS.items()
        )
    )
    server = await _router(keys)
    yield server
    await server.stop(None)


async def admin_call(address: str, key: str, call: str) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(address) as ch:
        method = getattr(admin_pb2_grpc.AdminStub(ch), call)
        try:
            await method(CALLS[call], metadata=bearer_metadata(key), timeout=10)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def test_a_drain_key_drains_and_is_refused_every_other_admin_call_naming_what_it_may(router) -> None:
    assert await admin_call(router.address, "drain-key", "DrainWorkers") == (grpc.StatusCode.OK, "")
    for call in ("ScaleWorkers", "ClusterStatus"):
        code, details = await admin_call(router.address, "drain-key", call)
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert (
            details == f"authorization: API key 'drain-key' may call only DrainWorkers of the Admin service, not {call}"
        )


async def test_an_admin_true_key_calls_all_and_an_admin_false_key_none(router) -> None:
    for call in CALLS:
        assert await admin_call(router.address, "admin-key", call) == (grpc.StatusCode.OK, ""), call
        code, details = await admin_call(router.address, "plain-key", call)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "may not call the Admin service" in details, details


async def test_a_drain_key_sends_requests_under_its_own_caps(router) -> None:
    """It is a key of the table like any other (`helm test` sends its chat request with it): its entry's caps hold."""

    async def generate(priority: int) -> grpc.StatusCode:
        request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2), priority=priority)
        async with grpc.aio.insecure_channel(router.address) as ch:
            try:
                async for _ in generate_pb2_grpc.GenerationStub(ch).Generate(
                    request, metadata=bearer_metadata("drain-key"), timeout=10
                ):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()
        return grpc.StatusCode.OK

    assert await generate(priority=1) == grpc.StatusCode.PERMISSION_DENIED  # above its max_priority
    assert await generate(priority=0) == grpc.StatusCode.UNAVAILABLE  # let in; no worker to serve it


async def test_a_router_refuses_to_start_on_an_admin_value_it_cannot_read(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[keys]]\nsha256 = "{digest("k")}"\ntenant = "ops"\nadmin = "drain"\n')
    with pytest.raises(ValueError, match=r"keys\[0\]: admin must be true, false or a list of Admin calls"):
        await _router(keys)
