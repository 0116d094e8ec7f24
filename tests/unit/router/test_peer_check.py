"""A router's readiness follows whether the workers accept its cluster credentials: asked over real gRPC of
workers' own WorkerControl service (pdserve's server, its cluster-secret check included). Refused by the workers
it asks, the router is not ready; one accepting is enough; workers that do not answer change nothing."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx2
import pytest

from pdserve.cluster.drain import DrainReport
from pdserve.cluster.drain_service import add_control_service
from pdserve.cluster.local_process import free_port
from pdserve.config import RouterConfig
from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.rpc.server import Server
from pdserve.security.cluster_secret import ClusterSecret
from pdserve.telemetry import Telemetry
from services.router.peer_check import PeerCheck
from services.router.server import start_router
from tests.unit.router.router_builder import worker

pytestmark = pytest.mark.timeout(60)
ROUTERS = b"the router's"


async def never_drained(timeout_s: float) -> DrainReport:
    raise AssertionError("not asked to drain")


@asynccontextmanager
async def control_server(secret: bytes) -> AsyncIterator[str]:
    """A worker's WorkerControl service on a loopback port, refusing calls without this secret's token."""
    server = Server("127.0.0.1", 0, cluster=ClusterSecret(secret))
    add_control_service(server, never_drained, "w")
    await server.start()
    try:
        yield server.address
    finally:
        await server.stop(None)


def checking(*addresses: str) -> PeerCheck:
    registry = InMemoryRegistry()
    for i, address in enumerate(addresses):
        registry.publish(worker(f"d{i}", "decode", address=address))
    return PeerCheck(registry, ClusterSecret(ROUTERS))


async def test_refused_by_every_worker_asked_then_accepted_once_one_takes_it(monkeypatch, caplog):
    monkeypatch.setenv(CLUSTER_SECRET_VAR, ROUTERS.decode())
    changes: list[bool] = []
    async with control_server(b"another") as refusing:
        peers = checking(refusing)

        async def changed() -> None:
            changes.append(peers.refused)

        peers.on_change = changed
        with caplog.at_level(logging.ERROR):
            await peers.check()
        assert peers.refused and changes == [True]
        assert any("d0" in r.getMessage() and "PDSERVE_CLUSTER_SECRET" in r.getMessage() for r in caplog.records)
        async with control_server(ROUTERS) as accepting:
            peers.registry.publish(worker("d1", "decode", address=accepting))
            await peers.check()  # one refusing, one accepting: the router's credentials are good
        assert not peers.refused and changes == [True, False]


async def test_workers_that_do_not_answer_leave_it_as_it_was(monkeypatch):
    monkeypatch.setenv(CLUSTER_SECRET_VAR, ROUTERS.decode())
    async with control_server(b"another") as refusing:
        peers = checking(refusing)
        await peers.check()
    assert peers.refused
    peers.registry.remove("d0")
    peers.registry.publish(worker("d1", "decode", address=f"127.0.0.1:{free_port()}"))  # nothing listens there
    await peers.check()
    assert peers.refused
    peers.registry.remove("d1")
    await peers.check()  # no worker at all
    assert peers.refused


async def test_the_same_secret_is_accepted(monkeypatch):
    monkeypatch.setenv(CLUSTER_SECRET_VAR, ROUTERS.decode())
    async with control_server(ROUTERS) as accepting:
        peers = checking(accepting)
        await peers.check()
    assert not peers.refused


async def test_http_health_is_not_ok_while_the_first_check_runs(monkeypatch):
    """A load balancer probing /health during the router's start must not see it ready before the workers were
    asked: a 200 then, and a rollout moves on past a router they refuse."""
    port, seen = free_port(), []

    async def refused_check(self: PeerCheck) -> None:
        try:
            async with httpx2.AsyncClient(timeout=5) as http:
                seen.append((await http.get(f"http://127.0.0.1:{port}/health")).status_code)
        except httpx2.ConnectError:
            seen.append(None)  # not listening yet
        self.refused = True

    monkeypatch.setattr(PeerCheck, "check", refused_check)
    telemetry = Telemetry("pdserve-router", enabled=False)
    args = ("tiny-random", InMemoryRegistry(), InMemoryPrefixIndex(), RouterConfig(), "127.0.0.1", 0, telemetry)
    server, _ = await start_router(*args, http_port=port)
    try:
        assert seen == [None]
        async with httpx2.AsyncClient(timeout=5) as http:
            assert (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 503
    finally:
        await server.stop(None)
