"""A drain-only key (every worker pod holds one, for its preStop hook) drains only the workers of the host it calls
from, as a real in-process router sees the caller over loopback: `DrainWorkers(host=...)` had drained every worker
on any host, and ids any worker. Other hosts' workers, by host or by id, registered or not, are PERMISSION_DENIED
alike; an admin key, and an open cluster, drain any."""

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
from pdserve.v1 import admin_pb2_grpc
from services.router.caller_host import peer_host
from services.router.server import RouterServer, start_router
from tests.unit.router.router_builder import worker

pytestmark = pytest.mark.timeout(60)
# Nothing listens on port 1: each drain is tried, fails at once, and is reported (the call itself is granted).
LOCAL, REMOTE = "127.0.0.1", "127.0.0.2"
KEYS = {"drain-key": '["DrainWorkers"]', "admin-key": "true"}
WHY = f"a drain-only API key may drain only the workers of the host it calls from ({LOCAL})"


async def _router(tmp_path: Path, keyed: bool) -> RouterServer:
    registry = InMemoryRegistry(ttl_s=600)
    registry.publish(worker("prefill-0", address=f"{LOCAL}:1"))
    registry.publish(worker("decode-0", "decode", address=f"{REMOTE}:1"))
    keys = tmp_path / "keys.toml"
    keys.write_text(
        "".join(
            f'[[keys]]\nname = "{k}"\nsha256 = "{digest(k)}"\ntenant = "ops"\nadmin = {a}\n' for k, a in KEYS.items()
        )
    )
    config = RouterConfig(api_keys_file=str(keys) if keyed else None, no_workers_wait_s=0.1)
    telemetry = Telemetry("pdserve-router", enabled=False)
    server, _ = await start_router("tiny-random", registry, InMemoryPrefixIndex(), config, LOCAL, 0, telemetry)
    return server


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[RouterServer]:
    server = await _router(tmp_path, keyed=True)
    yield server
    await server.stop(None)


async def drain(address: str, key: str | None, **request: object) -> tuple[grpc.StatusCode, str, list[str]]:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            r = await admin_pb2_grpc.AdminStub(ch).DrainWorkers(
                apb.DrainWorkersRequest(timeout_s=1, **request), metadata=bearer_metadata(key), timeout=20
            )
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or "", []
    return grpc.StatusCode.OK, "", [w.id for w in r.workers]


async def test_a_drain_key_drains_only_its_own_hosts_workers(router) -> None:
    assert await drain(router.address, "drain-key", host=LOCAL) == (grpc.StatusCode.OK, "", ["prefill-0"])
    assert await drain(router.address, "drain-key", worker_ids=["prefill-0"]) == (grpc.StatusCode.OK, "", ["prefill-0"])
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert await drain(router.address, "drain-key", host=REMOTE) == (denied, f"host: {WHY}, not those of {REMOTE}", [])
    # A worker elsewhere and an id of no worker read the same: nothing is learnt of other hosts.
    for ids in (["decode-0"], ["decode-9"], ["prefill-0", "decode-0"]):
        code, details, _ = await drain(router.address, "drain-key", worker_ids=ids)
        not_there = ", ".join(i for i in sorted(ids) if i != "prefill-0")
        assert (code, details) == (denied, f"worker_ids: {WHY}; not there: {not_there}"), ids


async def test_an_admin_key_and_an_open_cluster_drain_any_host(router, tmp_path: Path) -> None:
    assert await drain(router.address, "admin-key", host=REMOTE) == (grpc.StatusCode.OK, "", ["decode-0"])
    assert (await drain(router.address, "admin-key", worker_ids=["decode-9"]))[0] == grpc.StatusCode.INVALID_ARGUMENT
    open_router = await _router(tmp_path, keyed=False)
    try:
        assert await drain(open_router.address, None, host=REMOTE) == (grpc.StatusCode.OK, "", ["decode-0"])
    finally:
        await open_router.stop(None)


def test_a_peer_names_its_host_as_a_worker_address_does() -> None:
    assert peer_host("ipv4:10.0.0.5:43210") == "10.0.0.5"
    assert peer_host("ipv6:%5Bfd00:0::7%5D:43210") == "fd00::7"  # gRPC's own spelling, percent-encoded brackets
    assert peer_host("ipv6:[::ffff:10.0.0.5]:1") == "10.0.0.5"  # a dual-stack listener's IPv4 caller
    assert peer_host("unix:/run/router.sock") == ""  # no host: a drain-only key drains nothing
