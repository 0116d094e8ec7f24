"""A removal that names a worker's process (`instance`) takes out only that process's entry: a launcher resumed from a
freeze unlists a worker by the process it last saw, and Ray may have restarted it meanwhile, its new process listed
already. Both registries, Redis against a real redis-server (its compare-and-delete script, and the remover's own
router view)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from pdserve.protocol.roles import Role
from pdserve.registry.base import Registry, WorkerState
from pdserve.registry.memory import InMemoryRegistry
from pdserve.registry.redis import RedisRegistry
from tests.redis_server import emptied, started

pytestmark = pytest.mark.timeout(60)
server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)


def process(instance: str, port: int) -> WorkerState:
    return WorkerState("p0", Role.PREFILL, f"127.0.0.1:{port}", instance=instance)


@pytest.fixture(params=["memory", "redis"])
async def registry(request: pytest.FixtureRequest) -> AsyncIterator[Registry]:
    if request.param == "memory":
        yield InMemoryRegistry()
        return
    registry = RedisRegistry(request.getfixturevalue("url"), refresh_s=60)  # a view refreshed only by the test
    await registry.start()
    try:
        yield registry
    finally:
        await registry.close()


async def listed(registry: Registry) -> list[str]:
    """The instances a router sees now (a Redis view read afresh)."""
    if isinstance(registry, RedisRegistry):
        assert await registry.refresh()
    return [w.instance for w in registry.workers()]


async def test_removing_a_process_that_was_restarted_leaves_its_successors_entry(registry: Registry) -> None:
    registry.publish(process("old", 1))
    registry.publish(process("new", 2))  # Ray restarted it, on another port; it listed itself
    assert await listed(registry) == ["new"]
    registry.remove("p0", "old")  # the old process found gone, late
    assert [w.instance for w in registry.workers()] == ["new"]  # in the remover's own view too
    assert await listed(registry) == ["new"]
    registry.remove("p0", "new")
    assert await listed(registry) == []


async def test_a_removal_naming_no_process_takes_whatever_is_listed(registry: Registry) -> None:
    """A caller that knows no process (a worker too old to say its instance) removes as before."""
    registry.publish(process("new", 2))
    registry.remove("p0")
    assert await listed(registry) == []
    registry.remove("p0", "old")  # nothing listed: nothing to do
    assert await listed(registry) == []


async def test_an_entry_that_does_not_parse_stays_for_a_removal_naming_a_process(url: str, server) -> None:
    """Anyone with access to Redis may have written it: its TTL ends it, not a compare that cannot read it."""
    registry = RedisRegistry(url)
    with server.client() as c:
        c.set("pdserve:worker:p0", b"not json", px=5000)
        c.sadd("pdserve:workers", "p0")
        registry.remove("p0", "old")
        assert c.get("pdserve:worker:p0") == b"not json"
        registry.remove("p0")
        assert c.get("pdserve:worker:p0") is None and not c.smembers("pdserve:workers")
