"""The Redis registry against a real redis-server: TTL, two routers, a Redis restart, real workers heartbeating."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import redis

from pdserve.config import EngineConfig
from pdserve.protocol.perf_profile import PerfProfile
from pdserve.protocol.prefix_hash import prefix_hashes
from pdserve.registry.base import WorkerState
from pdserve.registry.redis import PREFIX, RedisPrefixIndex, RedisRegistry
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)
PROFILE = PerfProfile(0.01, 1e-3, 1e-8, 0.02, 0.005)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    srv = RedisServer()
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def url(server: RedisServer) -> str:
    if server.proc is None:  # a test that stopped it failed before restarting it
        server.start()
    with server.client() as c:
        c.flushall()
    return server.url


def state(worker_id: str, role: str = "prefill", **fields: object) -> WorkerState:
    fields.setdefault("profile", PROFILE)
    return WorkerState(worker_id=worker_id, role=role, address=f"{worker_id}:1", **fields)  # type: ignore[arg-type]


def ids(workers: list[WorkerState]) -> list[str]:
    return sorted(w.worker_id for w in workers)


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def test_a_published_worker_reads_back_whole_profile_included(url):
    worker = RedisRegistry(url)
    w = state("p-readback", kv_bytes_per_token=4096, kv_blocks_total=100, kv_blocks_free=40, speed_factor=1.5)
    d = state("d-readback", "decode", running=3)
    worker.publish(w)
    worker.publish(d)
    router = RedisRegistry(url)
    assert sorted(router.workers(), key=lambda s: s.worker_id) == [d, w]
    (got,) = router.workers("prefill")
    assert got == w and got.profile == PROFILE
    assert router.workers("decode") == [d]
    assert router.workers("colocated") == []


def test_a_worker_that_stops_heartbeating_expires(url, server):
    publisher = RedisRegistry(url, ttl_s=1.0)
    router = RedisRegistry(url, refresh_s=0.05)
    publisher.publish(state("quiet"))
    beating = state("beating")
    publisher.publish(beating)
    with server.client() as c:
        assert 0 < c.pttl(f"{PREFIX}:worker:quiet") <= 1000
    assert ids(router.workers()) == ["beating", "quiet"]
    deadline = time.monotonic() + 5
    while "quiet" in ids(router.workers()):
        assert time.monotonic() < deadline, "a silent worker outlived its TTL"
        beating = replace(beating, running=beating.running + 1, updated_at=time.time())
        publisher.publish(beating)
        time.sleep(0.1)
    assert ids(router.workers()) == ["beating"]
    assert router.workers()[0].running == beating.running  # and its heartbeats did arrive
    with server.client() as c:  # the expired id is cleaned from the set of workers
        assert c.smembers(f"{PREFIX}:workers") == {b"beating"}


def test_remove_is_seen_at_once_by_its_router_and_soon_by_others(url):
    r1, r2 = RedisRegistry(url, refresh_s=0.05), RedisRegistry(url, refresh_s=0.05)
    r1.publish(state("gone"))
    r1.publish(state("stays"))
    assert ids(r1.workers()) == ids(r2.workers()) == ["gone", "stays"]
    r1.remove("gone")
    assert ids(r1.workers()) == ["stays"]  # no refresh needed
    wait_for(lambda: ids(r2.workers()) == ["stays"], 2, "the other router to drop the removed worker")


def test_two_routers_see_the_same_workers_and_share_the_prefix_index(url):
    worker = RedisRegistry(url)
    for i in range(3):
        worker.publish(state(f"p{i}"))
    worker.publish(state("d0", "decode"))
    router_a, router_b = RedisRegistry(url, refresh_s=0.05), RedisRegistry(url, refresh_s=0.05)
    assert ids(router_a.workers("prefill")) == ids(router_b.workers("prefill")) == ["p0", "p1", "p2"]
    worker.publish(state("p3"))
    wait_for(lambda: "p3" in ids(router_a.workers()) and "p3" in ids(router_b.workers()), 2, "both to see p3")

    index_a, index_b = RedisPrefixIndex(url), RedisPrefixIndex(url)
    hashes = prefix_hashes(list(range(1, 161)), 16)  # 10 blocks
    index_a.record("p1", hashes[:7])
    index_a.record("p2", hashes[1:])  # no block 0: no hit
    index_a.record("p3", [hashes[0], hashes[2]])  # a gap after block 0
    assert index_b.match(["p0", "p1", "p2", "p3"], hashes) == {"p0": 0, "p1": 7, "p2": 0, "p3": 1}
    assert index_b.match(["p1"], []) == {"p1": 0}
    assert index_b.match([], hashes) == {}
    index_b.record("p0", hashes)  # and the other way round
    assert index_a.match(["p0"], hashes) == {"p0": 10}


def test_prefix_index_is_bounded_per_worker_dropping_the_least_recently_used(url):
    index = RedisPrefixIndex(url, max_blocks_per_worker=3)
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    for h in (a, b, c):
        index.record("w", [h])
        time.sleep(0.01)  # distinct last-use scores
    index.record("w", [a])  # a used again: b is the oldest
    time.sleep(0.01)
    index.record("w", [d])
    other = RedisPrefixIndex(url)
    assert {h: other.match(["w"], [h])["w"] for h in (a, b, c, d)} == {a: 1, b: 0, c: 1, d: 1}
    with redis.Redis.from_url(url) as client:
        assert client.zcard(f"{PREFIX}:prefix:w") == 3


def test_expired_worker_cleanup_failing_does_not_break_the_view(url, server, monkeypatch):
    publisher = RedisRegistry(url)
    publisher.publish(state("live"))
    with server.client() as c:
        c.sadd(f"{PREFIX}:workers", "ghost")  # listed, but its key has expired
    router = RedisRegistry(url)

    def lost(*args: object, **kwargs: object) -> None:
        raise redis.ConnectionError("connection lost mid-refresh")

    monkeypatch.setattr(router._redis, "srem", lost)
    assert ids(router.workers()) == ["live"]  # workers() never raises for a lost backend


def test_redis_restart_serves_the_last_view_then_picks_up_again(url, server):
    router = RedisRegistry(url, refresh_s=0.05, retry_s=0.2)
    index = RedisPrefixIndex(url)
    publisher = RedisRegistry(url)
    before = state("before-restart")
    publisher.publish(before)
    index.record("before-restart", [b"h0"])
    assert router.workers() == [before]

    server.stop()
    try:
        time.sleep(0.1)  # past refresh_s: the next call does go to Redis
        for _ in range(10):
            start = time.monotonic()
            assert router.workers() == [before]
            assert router.workers("prefill") == [before]
            assert time.monotonic() - start < 1.0, "a router call stalled on a dead Redis"
            time.sleep(0.05)
        start = time.monotonic()
        index.record("before-restart", [b"h1"])  # a lost hint, not an error
        assert index.match(["before-restart"], [b"h0"]) == {"before-restart": 0}
        assert time.monotonic() - start < 1.0
        with pytest.raises(redis.RedisError):
            publisher.publish(state("while-down"))  # workers see the error and retry on their next beat
        fresh = RedisRegistry(url)
        assert fresh.workers() == []  # never reached Redis: an empty view, still no exception
    finally:
        server.start()

    after = state("after-restart", "decode")

    def published() -> bool:
        try:
            publisher.publish(after)
            return True
        except redis.RedisError:
            return False

    wait_for(published, 5, "a publish to succeed after the restart")
    # The restarted server kept nothing (no persistence): only what was published since.
    wait_for(lambda: ids(router.workers()) == ["after-restart"], 5, "the router to see the new publish")
    assert router.workers("decode") == [after]
    index.record("after-restart", [b"h0"])
    assert index.match(["after-restart"], [b"h0"]) == {"after-restart": 1}


def test_real_workers_heartbeat_into_redis_and_deregister_on_stop(url):
    from pdserve.cluster.worker_runtime import WorkerRuntime
    from pdserve.cluster.worker_spec import WorkerSpec
    from services.workers import add_worker_services

    engine = EngineConfig(model="tiny-random", num_threads=1, kv_cache_memory_gb=0.05)
    suffix = uuid.uuid4().hex[:6]

    def worker(role: str, worker_id: str) -> WorkerRuntime:
        spec = WorkerSpec(role, engine, worker_id=worker_id, registry_url=url, heartbeat_s=0.2)
        return WorkerRuntime(spec, add_worker_services)

    prefill = worker("prefill", f"pw-{suffix}")
    decode = worker("decode", f"dw-{suffix}")
    try:
        addresses = {prefill.worker_id: prefill.address(60), decode.worker_id: decode.address(60)}
        router = RedisRegistry(url, refresh_s=0.05)

        def both_with_profiles() -> bool:
            seen = {w.worker_id: w for w in router.workers()}
            return set(seen) == set(addresses) and all(w.profile is not None for w in seen.values())

        wait_for(both_with_profiles, 10, "both workers to register with profiles")
        (p,) = router.workers("prefill")
        (d,) = router.workers("decode")
        assert p.model_fingerprint == d.model_fingerprint != ""  # one model on both sides of the hand-off
        for w, runtime in ((p, prefill), (d, decode)):
            assert w.worker_id == runtime.worker_id and w.address == addresses[w.worker_id]
            assert w.block_size == engine.block_size and w.kv_bytes_per_token > 0
            assert 0 < w.kv_blocks_free <= w.kv_blocks_total
            assert all(v >= 0 for v in w.profile.to_dict().values())
            assert w.profile.prefill_s(128) > 0 and w.profile.decode_step_s(8) > 0

        # Stop the decode worker on another thread and time its disappearance from the first call: a heartbeat
        # TTL (at least 2 s here) would only drop it later, deregistration drops it at once.
        stopper = threading.Thread(target=decode.stop)
        start = time.monotonic()
        stopper.start()
        wait_for(lambda: router.workers("decode") == [], 10, "the stopped worker to leave the registry")
        gone_after = time.monotonic() - start
        stopper.join(30)
        assert not stopper.is_alive()
        assert gone_after < 1.5, f"took {gone_after:.1f} s: expired by TTL instead of deregistering?"
        time.sleep(0.5)  # several heartbeats later: still gone, and the other still there
        assert ids(router.workers()) == [prefill.worker_id]
    finally:
        decode.stop()
        prefill.stop()
