"""The prefix index in a real redis-server: a real worker's heartbeat writes what its prefix cache keyed and evicted
into its own entry, and a match over a long prompt asks Redis for what the hits are, not for the whole prompt on
every worker."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid

import pytest
import redis

from pdserve.cluster.worker_runtime import WorkerRuntime
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import EngineConfig
from pdserve.engine.cache_journal import PrefixCacheChanges, PrefixCacheJournal
from pdserve.protocol.prefix_hash import prefix_hashes
from pdserve.registry import redis_prefix
from pdserve.registry.prefix_holders import BACKSTOP_S, SLOTS_KEY
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
        apply_changes(client, left_by, PrefixCacheChanges([b"x" * 16], [], whole=True), first=True)
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
        keyed = state.kv_blocks_total - 1  # its last block holds the last prompt token and the output: not full
        assert await hits(index, state.cache_key, whole_cache, 5.0, want=keyed) == keyed
        assert client.zcard(prefix_key(state.cache_key)) == keyed + 1  # and the mark of its whole copy
        others = {k.decode() for k in client.scan_iter(match=prefix_key("*"))} - {prefix_key(state.cache_key)}
        assert others == {prefix_key("cw-prefix2/another-worker")}  # its last process's went at its first beat
        client.flushall()  # Redis restarted empty: the worker's next beats copy its whole cache again
        assert await hits(index, state.cache_key, whole_cache, 5.0, want=keyed) == keyed
    finally:
        await index.close()
        worker.stop()
    assert not client.exists(prefix_key(state.cache_key))  # it left: its entry went with it
    client.close()


async def test_a_long_prompts_match_counts_each_workers_leading_run_and_an_unreadable_entry_costs_only_its_own(url):
    prompt = prefix_hashes(list(range(20 * FIRST_PROBE_BLOCKS * BS)), BS)  # 1280 blocks: probes of 64, 256, 960
    with redis.Redis.from_url(url) as client:
        apply_changes(client, "all/1", PrefixCacheChanges(prompt, [], whole=True))
        apply_changes(client, "some/1", PrefixCacheChanges(prompt[:100] + prompt[101:], [], whole=True))  # a gap
        apply_changes(client, "head/1", PrefixCacheChanges(prompt[:FIRST_PROBE_BLOCKS], [], whole=True))
        assert apply_changes(client, "all/1", PrefixCacheChanges([], prompt[1000:]))
        client.hset(SLOTS_KEY, "broken/1", "not a slot")  # a mapping that does not parse
    index = RedisPrefixIndex(url, match_budget_s=1.0)
    keys = ["all/1", "some/1", "head/1", "broken/1", "none/1"]
    assert await index.match(keys, prompt) == {"all/1": 1000, "some/1": 100, "head/1": 64, "broken/1": 0, "none/1": 0}
    assert await index.match(["all/1"], prompt[:3]) == {"all/1": 3}  # no outage was taken from the broken entry
    await index.close()


async def test_placements_never_push_out_what_the_worker_says_it_caches(url):
    cached = [bytes([i]) * 16 for i in range(4)]
    with redis.Redis.from_url(url) as client:
        apply_changes(client, "w/1", PrefixCacheChanges(cached, [], whole=True))
    index = RedisPrefixIndex(url, max_blocks_per_worker=6, match_budget_s=1.0)
    for i in range(8):  # placements of other prompts, trimmed to 6: the oldest placements go first
        index.record("w/1", [bytes([100 + i]) * 16])
        await index.flush()
    assert await index.match(["w/1"], cached) == {"w/1": 4}
    assert await index.match(["w/1"], [bytes([107]) * 16]) == {"w/1": 1}  # the newest placement stays
    assert await index.match(["w/1"], [bytes([101]) * 16]) == {"w/1": 0}  # the oldest went
    with redis.Redis.from_url(url) as client:
        assert client.zcard(prefix_key("w/1")) == 4 + 1 + 6  # cached, the mark, 6 placements
    await index.close()


async def test_an_entry_redis_lost_makes_the_next_take_whole_and_a_whole_copy_is_swapped_in(url, monkeypatch):
    monkeypatch.setattr(redis_prefix, "WHOLE_CHUNK", 3)  # several chunks aside, one swap
    keys = [bytes([i]) * 16 for i in range(8)]
    with redis.Redis.from_url(url) as client:
        assert apply_changes(client, "w/1", PrefixCacheChanges(keys[:7], [], whole=True))
        assert client.zcard(prefix_key("w/1")) == 7 + 1 and not client.exists(prefix_key("w/1") + ":staging")
        assert apply_changes(client, "w/1", PrefixCacheChanges(keys[7:], keys[:1]))
        client.flushall()  # a restart without persistence
        assert not apply_changes(client, "w/1", PrefixCacheChanges([], keys[1:2]))  # the worker must send all
        assert apply_changes(client, "w/1", PrefixCacheChanges(keys[2:], [], whole=True))
        assert set(client.zrange(prefix_key("w/1"), 0, -1)) == {*keys[2:], redis_prefix.WHOLE_MARK}
        assert 0 < client.ttl(prefix_key("w/1")) <= BACKSTOP_S  # and its lease, an hour, in its slot's mapping:
        lease_end = int(client.hget(SLOTS_KEY, "w/1").split(b":")[1])
        assert 0 < lease_end - int(client.time()[0]) <= 3600
        client.unlink(prefix_key("w/1"))  # the key evicted alone
        assert not apply_changes(client, "w/1", PrefixCacheChanges([], []))


async def test_two_processes_of_one_worker_id_keep_each_others_entries_after_their_first_copies(url):
    """Only a process's first whole copy drops its worker id's other entries: two alive at once (a killed actor
    lingering) dropped each other's at every whole copy, so each beat of each was a whole copy again."""
    keys = [bytes([i]) * 16 for i in range(3)]
    with redis.Redis.from_url(url) as client:
        assert apply_changes(client, "w/old", PrefixCacheChanges(keys, [], whole=True), first=True)
        assert apply_changes(client, "w/new", PrefixCacheChanges(keys, [], whole=True), first=True)
        assert not client.exists(prefix_key("w/old"))  # the new process's first copy: the old entry goes
        assert apply_changes(client, "w/old", PrefixCacheChanges(keys, [], whole=True))  # lost: copied again
        assert apply_changes(client, "w/new", PrefixCacheChanges([], keys[:1]))  # and the new one's stays intact


async def test_a_heartbeat_that_fails_logs_its_redis_without_the_password(caplog):
    """A password in `--redis`'s URL is a credential: a failed heartbeat's warning names the Redis without it."""
    engine = EngineConfig(model="tiny-random", num_threads=1, kv_cache_memory_gb=0.0003)
    down = "redis://:hunter2@127.0.0.1:1/0"  # nothing listens there
    spec = WorkerSpec("colocated", engine, worker_id="cw-down", registry_url=down, heartbeat_s=0.05)
    caplog.set_level(logging.WARNING)
    worker = WorkerRuntime(spec, add_worker_services)
    try:
        await asyncio.to_thread(worker.address, 120)
        end = time.monotonic() + 10
        while not (said := [r.getMessage() for r in caplog.records if "heartbeat to" in r.getMessage()]):
            assert time.monotonic() < end, "no heartbeat failure logged"
            await asyncio.sleep(0.05)
    finally:
        worker.stop()
    assert "redis://***@127.0.0.1:1/0" in said[0], said
    assert not [r for r in caplog.records if "hunter2" in r.getMessage()]


def test_an_entry_holding_fewer_of_the_workers_keys_than_it_caches_is_copied_whole_again(url):
    """A writer that lowered the worker's own keys to placement scores and trimmed them (a router of a build before
    `GT`, in an earlier format): the worker's deltas alone would never send them back."""
    keys = [bytes([i]) * 16 for i in range(4)]
    journal = PrefixCacheJournal(max_removed=16)
    for key in keys:
        journal.stored(key)
    with redis.Redis.from_url(url) as client:
        assert apply_changes(client, "w/1", journal.take(), first=True)
        client.zadd(prefix_key("w/1"), dict.fromkeys(keys[:2], time.time()))  # the earlier router's placement
        client.zremrangebyscore(prefix_key("w/1"), "-inf", f"({redis_prefix.CACHED}")  # and its trim
        journal.stored(b"e" * 16)
        assert not apply_changes(client, "w/1", journal.take())  # the entry holds 3 of its 5 keys
        journal.lost()  # as the worker's heartbeat answers it
        assert apply_changes(client, "w/1", journal.take())
        assert client.zcount(prefix_key("w/1"), redis_prefix.CACHED, "+inf") == 5 + 1  # and the mark


async def test_an_entry_undone_each_beat_is_copied_whole_once_a_while_not_each_beat(url, monkeypatch):
    """A writer lowering the worker's keys at every placement (a router of a build before `GT`, in an earlier format)
    made every beat a whole copy (one of a 262k-block cache holds Redis ~0.5 s)."""
    engine = EngineConfig(model="tiny-random", num_threads=1, kv_cache_memory_gb=0.0003)
    spec = WorkerSpec("colocated", engine, worker_id="cw-undone", registry_url=url, heartbeat_s=0.05)
    client = redis.Redis.from_url(url)
    worker = WorkerRuntime(spec, add_worker_services)
    try:
        address = await asyncio.to_thread(worker.address, 120)
        await generate(address, [3 + i % 200 for i in range(64)])  # four keys
        key = prefix_key(worker.state().cache_key)
        end = time.monotonic() + 5
        while client.zcount(key, redis_prefix.CACHED, "+inf") < 5:
            assert time.monotonic() < end, "the worker's keys never reached its entry"
            await asyncio.sleep(0.05)
        swapped: list[str] = []  # each whole copy swapped in (the real one, counted)
        replace = redis_prefix._replace
        monkeypatch.setattr(redis_prefix, "_replace", lambda c, k, *a: (swapped.append(k), replace(c, k, *a)))
        end = time.monotonic() + 1.5
        while time.monotonic() < end:  # ~30 beats, each finding its keys lowered to placements
            own = client.zrangebyscore(key, redis_prefix.CACHED, "(+inf")
            if own:
                client.zadd(key, dict.fromkeys(own, time.time()))
            await asyncio.sleep(0.02)
        copies = len(swapped)
    finally:
        worker.stop()
        client.close()
    assert 1 <= copies <= 2, copies  # the first undoing is copied back at once; the rest wait WHOLE_COPY_EVERY_S


def test_a_whole_copy_cut_short_is_made_again_at_the_next_beat(url):
    """Redis going away mid-copy (a restart) starts no wait: the throttle counts copies made, not tried."""
    from types import SimpleNamespace

    journal = PrefixCacheJournal(max_removed=16)
    journal.stored(b"k" * 16)
    runtime = SimpleNamespace(_engine=SimpleNamespace(prefix_journal=journal), _whole_copied_at=-math.inf)
    state = SimpleNamespace(cache_key="w/1")
    beat = WorkerRuntime._index_prefix_changes
    with redis.Redis.from_url(url) as client:
        beat(runtime, SimpleNamespace(client=client), state, True)  # the first copy
        client.flushall()  # Redis restarted empty
        beat(runtime, SimpleNamespace(client=client), state, False)  # finds the entry lost
        with redis.Redis(port=1) as down, pytest.raises(redis.ConnectionError):
            beat(runtime, SimpleNamespace(client=down), state, False)  # the whole copy, cut short
        beat(runtime, SimpleNamespace(client=client), state, False)
        assert client.zcard(prefix_key("w/1")) == 1 + 1  # copied again at once: the key and the mark
