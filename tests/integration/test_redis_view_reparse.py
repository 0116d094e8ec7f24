"""A router's view refresh parses only the entries rewritten since its last read, against a real redis-server: every
router reads every worker's entry 4 times a second while each worker rewrites its own twice, and parsing them all took
a router's loop ~18 ms a refresh at 256 workers (docs/experiments/router_at_scale/)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.protocol.perf_profile import PerfProfile
from pdserve.registry.base import WorkerState
from pdserve.registry.redis import RedisRegistry, connect_async, worker_key
from tests.redis_server import emptied, started

pytestmark = pytest.mark.timeout(60)
server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)


def state(worker_id: str, **fields: object) -> WorkerState:
    profile = PerfProfile(0.01, 1e-3, 1e-8, 0.02, 0.005)
    return WorkerState(worker_id=worker_id, role="prefill", address=f"{worker_id}:1", profile=profile, **fields)  # type: ignore[arg-type]


async def test_an_entry_not_rewritten_since_the_last_refresh_is_kept_as_parsed_and_a_rewritten_one_is_read_anew(
    url, monkeypatch
):
    parsed: list[str] = []  # the entries parsed, by worker id: WorkerState.from_json counted, its answer unchanged
    from_json = WorkerState.from_json

    def counted(text: str | bytes) -> WorkerState:
        state = from_json(text)
        parsed.append(state.worker_id)
        return state

    monkeypatch.setattr(WorkerState, "from_json", staticmethod(counted))
    workers = RedisRegistry(url, ttl_s=60)  # the workers' side: publishing
    router = RedisRegistry(url, ttl_s=60)
    router._async = connect_async(url)  # a router's view, refreshed by hand here instead of every 0.25 s
    try:
        a, b = state("a", kv_blocks_free=10), state("b", kv_blocks_free=20)
        workers.publish(a)
        workers.publish(b)
        assert await router.refresh()
        first = {w.worker_id: w for w in router.workers()}
        assert first == {"a": a, "b": b}
        workers.publish(b2 := replace(b, kv_blocks_free=19, updated_at=b.updated_at + 0.5))  # b's next heartbeat
        assert await router.refresh()
        second = {w.worker_id: w for w in router.workers()}
        assert parsed == ["a", "b", "b"]  # a's bytes unchanged: not parsed again (each read is heard anew)
        assert second["a"] == a and second["b"] == b2
        workers.client.set(worker_key("a"), b"{not json")  # rewritten by anyone with access to Redis
        assert await router.refresh()
        assert [w.worker_id for w in router.workers()] == ["b"]  # skipped, as any malformed entry
        workers.publish(a)
        assert await router.refresh()
        assert {w.worker_id: w for w in router.workers()}["a"] == a
    finally:
        await router.close()
        workers.client.close()
