"""The prefix index in a real redis-server: a real worker's heartbeat writes what its prefix cache keyed and evicted
into its own entry, and a match over a long prompt asks Redis for what the hits are, not for the whole prompt on
every worker."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from pdserve.cluster.worker_runtime import WorkerRuntime
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import EngineConfig
from pdserve.engine.cache_journal import PrefixCacheChanges
from pdserve.protocol.prefix_hash import prefix_hashes
from pdserve.registry.redis_prefix import FIRST_PROBE_BLOCKS, RedisPrefixIndex, apply_changes, prefix_key
from pdserve.rpc.server import channel
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc
from services.workers import add_worker_services
from tests.redis_server import emptied, started

pytestmark = pytest.mark.timeout(180)
BS = 16
server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)


async def generate(address: str, prompt: list[int]) -> None:
    req = wpb.WorkerGenerateRequest(
        request_id=uuid.uuid4().hex, prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=1, ignore_eos=True)
    )
    async with channel(address) as ch:
        async for _ in worker_pb2_grpc.DecodeWorkerStub(ch).Generate(req, timeout=60):
            pass


async def hits(index: RedisPrefixIndex, cache_key: str, prompt: list[int], timeout_s: float, want: int) -> int:
    """The index's leading hits for `prompt`'s full blocks, once they are `want` (or the last seen at the timeout)."""
    end = time.monotonic() + timeout_s
    while True:
        found = (await index.match([cache_key], prefix_hashes(prompt, BS)))[cache_key]
        if found == want or time.monotonic() > end:
            return found
        await asyncio.sleep(0.05)


async def test_a_workers_heartbeat_indexes_what_it_cached_and_unindexes_what_it_evicted(url):
    engine = EngineConfig(model="tiny-random", num_threads=1, kv_cache_memory_gb=0.0003)  # ~39 blocks
    spec = WorkerSpec("colocated", engine, worker_id="cw-prefix", registry_url=url, heartbeat_s=0.1)
    client = redis.Redis.from_url(url)
    for left_by in ("cw-prefix/its-last-process", "cw-prefix2/another-worker"):
        apply_changes(client, left_by, PrefixCacheChanges([b"x" * 16], []), 10)
    worker = WorkerRuntime(spec, add_worker_services)
    index = RedisPrefixIndex(url, match_budget_s=1.0)
    try:
        address = await asyncio.to_thread(worker.address, 120)
        state = worker.state()
        a = [3 + i % 200 for i in range(32)]  # exactly two blocks: a router placing it records one (a hit ends
        await generate(address, a)  # short of the last token) but the worker keys both
        assert await hits(index, state.cache_key, a, 5.0, want=2) == 2
        whole_cache = [5 + i % 190 for i in range(state.kv_blocks_total * BS - 1)]
        await generate(address, whole_cache)  # takes every block: a's are evicted
        assert await hits(index, state.cache_key, a, 5.0, want=0) == 0
        assert await hits(index, state.cache_key, whole_cache, 5.0, want=state.kv_blocks_total - 1) > 0
        assert client.zcard(prefix_key(state.cache_key)) <= state.kv_blocks_total
        others = {k.decode() for k in client.scan_iter(match=prefix_key("*"))} - {prefix_key(state.cache_key)}
        assert others == {prefix_key("cw-prefix2/another-worker")}  # its last process's entry went at its first beat
    finally:
        await index.close()
        worker.stop()
    assert not client.exists(prefix_key(state.cache_key))  # it deregistered: its entry went with it
    client.close()


async def test_a_long_prompts_match_counts_each_workers_leading_run_and_an_unreadable_entry_costs_only_its_own(url):
    prompt = prefix_hashes(list(range(20 * FIRST_PROBE_BLOCKS * BS)), BS)  # 1280 blocks: four probes
    with redis.Redis.from_url(url) as client:
        apply_changes(client, "all/1", PrefixCacheChanges(prompt, [], whole=True), 4096)
        apply_changes(client, "some/1", PrefixCacheChanges(prompt[:100] + prompt[101:], []), 4096)  # a gap at 100
        apply_changes(client, "head/1", PrefixCacheChanges(prompt[:FIRST_PROBE_BLOCKS], []), 4096)
        client.set(prefix_key("broken/1"), "not a sorted set")
        apply_changes(client, "all/1", PrefixCacheChanges([], prompt[1000:]), 4096)
    index = RedisPrefixIndex(url, match_budget_s=1.0)
    keys = ["all/1", "some/1", "head/1", "broken/1", "none/1"]
    assert await index.match(keys, prompt) == {"all/1": 1000, "some/1": 100, "head/1": 64, "broken/1": 0, "none/1": 0}
    assert await index.match(["all/1"], prompt[:3]) == {"all/1": 3}  # no outage was taken from the broken entry
    await index.close()


async def test_a_whole_take_replaces_the_entry_and_the_entry_is_trimmed_to_the_workers_blocks(url):
    keys = [bytes([i]) * 16 for i in range(8)]
    with redis.Redis.from_url(url) as client:
        apply_changes(client, "w/1", PrefixCacheChanges(keys[:6], []), 4096)
        apply_changes(client, "w/1", PrefixCacheChanges(keys[6:], [], whole=True), 4096)
        assert set(client.zrange(prefix_key("w/1"), 0, -1)) == set(keys[6:])
        apply_changes(client, "w/1", PrefixCacheChanges(keys[:4], []), 3)
        assert client.zcard(prefix_key("w/1")) == 3
        assert 0 < client.ttl(prefix_key("w/1")) <= 3600
