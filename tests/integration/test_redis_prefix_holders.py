"""The holders index in a real redis-server: a block's bitmap holds a worker process's bit exactly while its entry
holds the block (through evictions, trims, whole copies, a process leaving and a lease running out), and a slot is
handed out again only once its former owner's bits are cleared, so no entry ever inherits another's blocks."""

from __future__ import annotations

import pytest
import redis

from pdserve.engine.cache_journal import PrefixCacheChanges
from pdserve.registry import prefix_holders as holders
from pdserve.registry.prefix_holders import BLOCKS_KEY, CACHED, KEYS, SLOTS_KEY
from pdserve.registry.redis_prefix import RedisPrefixIndex, apply_changes, drop_own_entry, sweep
from tests.redis_server import emptied, started

pytestmark = pytest.mark.timeout(120)
server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)
A = [bytes([1, i]) * 8 for i in range(40)]  # one prompt's blocks
B = [bytes([2, i]) * 8 for i in range(40)]  # another's


def holders_of(client: redis.Redis, block: bytes) -> set[str]:
    """Whose bits `block`'s bitmap holds: cache keys, or `slot N` for a slot no entry maps to (a stale bit)."""
    owners = {int(v.split(b":")[0]): k.decode() for k, v in client.hgetall(SLOTS_KEY).items() if k[:1] != b"\0"}
    bitmap = client.hget(BLOCKS_KEY, block) or b""
    return {owners.get(s, f"slot {s}") for s in range(8 * len(bitmap)) if bitmap[s // 8] >> (s % 8) & 1}


def indexed(client: redis.Redis) -> int:
    """Blocks with a bitmap (the epoch's field aside)."""
    return max(0, client.hlen(BLOCKS_KEY) - 1)


def swept(client: redis.Redis) -> None:
    while sweep(client):
        pass


async def test_a_blocks_bit_leaves_with_its_eviction_and_its_placements_trim(url):
    with redis.Redis.from_url(url) as client:
        assert apply_changes(client, "w/1", PrefixCacheChanges(A[:10], [], whole=True))
        assert apply_changes(client, "v/1", PrefixCacheChanges(A[:4], [], whole=True))
        assert apply_changes(client, "w/1", PrefixCacheChanges(B[:1], A[2:3]))  # evicts A[2], keys B[0]
        assert holders_of(client, A[2]) == {"v/1"} and holders_of(client, A[3]) == {"w/1", "v/1"}
        assert holders_of(client, B[0]) == {"w/1"}
        index = RedisPrefixIndex(url, max_blocks_per_worker=3, match_budget_s=5.0)
        try:
            for i in range(5):  # placements past the 3 an entry keeps: the oldest go, and their bits
                index.record("w/1", [B[10 + i]])
                await index.flush()
            assert [holders_of(client, b) for b in B[10:15]] == [set(), set(), {"w/1"}, {"w/1"}, {"w/1"}]
            assert await index.match(["w/1", "v/1"], A) == {"w/1": 2, "v/1": 4}
        finally:
            await index.close()


async def test_a_leaving_processs_bits_are_cleared_before_its_slot_is_reused(url, monkeypatch):
    monkeypatch.setattr(holders, "WALK_CHUNK", 7)  # a walk of several steps
    with redis.Redis.from_url(url) as client:
        assert apply_changes(client, "w/1", PrefixCacheChanges(A, [], whole=True), first=True)
        drop_own_entry(client, "w/1")
        index = RedisPrefixIndex(url, match_budget_s=5.0)
        try:
            assert await index.match(["w/1"], A) == {"w/1": 0}  # gone at once
            index.record("p/1", B[:3])  # a router's placement on a new process meanwhile: a fresh slot
            await index.flush()
            swept(client)
            assert indexed(client) == 3  # w/1's 40 bitmaps went, bit by bit
            index.record("q/1", B[20:22])  # takes w/1's slot, now free: none of A comes with it
            await index.flush()
            assert holders_of(client, B[20]) == {"q/1"}
            assert client.hget(SLOTS_KEY, "q/1").split(b":")[0] == b"0"  # w/1's, reused
            assert await index.match(["q/1", "p/1"], A) == {"q/1": 0, "p/1": 0}
            assert await index.match(["q/1", "p/1"], B) == {"q/1": 0, "p/1": 3}
        finally:
            await index.close()


async def test_an_entry_whose_lease_ran_out_is_swept_and_its_bits_cleared(url):
    with redis.Redis.from_url(url) as client:
        assert apply_changes(client, "gone/1", PrefixCacheChanges(A, [], whole=True))
        assert apply_changes(client, "live/1", PrefixCacheChanges(A[:5], [], whole=True))
        slot = client.hget(SLOTS_KEY, "gone/1").split(b":")[0]
        client.hset(SLOTS_KEY, "gone/1", slot + b":1")  # its lease ended long ago: its worker stopped beating
        swept(client)
        assert not client.hexists(SLOTS_KEY, "gone/1")
        assert holders_of(client, A[0]) == {"live/1"} and indexed(client) == 5
        assert not apply_changes(client, "gone/1", PrefixCacheChanges([], A[:1]))  # back after all: copy it whole


async def test_a_whole_copy_swaps_in_a_fresh_slot_and_the_former_and_a_cut_copys_bits_go(url):
    with redis.Redis.from_url(url) as client:
        assert apply_changes(client, "w/1", PrefixCacheChanges(A, [], whole=True))
        client.register_script(holders.script(holders.STAGE))(KEYS, ["w/1", 0])  # a copy begun, and its first chunk
        client.register_script(holders.script(holders.STAGE_MORE))(KEYS, ["w/1:staging", repr(CACHED), *B[:8]])
        # and then cut short (Redis went away): the next beat copies again
        assert holders_of(client, B[0]) == {"w/1:staging"} and holders_of(client, A[0]) == {"w/1"}
        assert apply_changes(client, "w/1", PrefixCacheChanges(B[:30], [], whole=True))
        index = RedisPrefixIndex(url, match_budget_s=5.0)
        try:
            assert await index.match(["w/1"], A) == {"w/1": 0}  # swapped at once
            assert await index.match(["w/1"], B) == {"w/1": 30}
        finally:
            await index.close()
        swept(client)
        assert indexed(client) == 30 and all(holders_of(client, b) == {"w/1"} for b in B[:30])


async def test_an_index_half_lost_starts_afresh_and_hands_no_slot_out_with_stale_bits(url):
    """Its mappings deleted by hand (or left to expire) while the bitmaps stay: slots would be handed out again with
    their former owners' bits, so the next write resets the index, and workers copy their caches again."""
    with redis.Redis.from_url(url) as client:
        assert apply_changes(client, "w/1", PrefixCacheChanges(A, [], whole=True))
        client.delete(SLOTS_KEY)
        index = RedisPrefixIndex(url, match_budget_s=5.0)
        try:
            index.record("p/1", B[:2])
            await index.flush()
            assert await index.match(["p/1"], A) == {"p/1": 0}
            assert indexed(client) == 2
            assert not apply_changes(client, "w/1", PrefixCacheChanges([], A[:1]))  # lost: the next take is whole
        finally:
            await index.close()


async def test_a_routers_kept_slots_never_read_a_reused_slot_as_its_former_owners(url):
    """A router keeps the slots it read while the mappings' version holds. w/1 leaves, its bits are swept and its slot
    is handed to another process's copy under way: the router's next match, given w/1's slot as it read it, is
    answered "stale" and reads the mappings again, so w/1 holds nothing (not the copy's blocks); an entry that came
    since (from no index at all, a copy swapped in, a placement on a new process) is seen at the next match."""
    index = RedisPrefixIndex(url, match_budget_s=5.0)
    try:
        assert await index.match(["w/1"], A) == {"w/1": 0}  # no index yet
        with redis.Redis.from_url(url) as client:
            assert apply_changes(client, "w/1", PrefixCacheChanges(A, [], whole=True))
            assert await index.match(["w/1", "q/1", "p/1"], A) == {"w/1": 40, "q/1": 0, "p/1": 0}  # slots kept
            slot = client.hget(SLOTS_KEY, "w/1").split(b":")[0]
            drop_own_entry(client, "w/1")
            swept(client)
            client.register_script(holders.script(holders.STAGE))(KEYS, ["q/1", 0])
            client.register_script(holders.script(holders.STAGE_MORE))(KEYS, ["q/1:staging", repr(CACHED), *A[:10]])
            assert client.hget(SLOTS_KEY, "q/1:staging").split(b":")[0] == slot  # w/1's, reused
            assert await index.match(["w/1", "q/1", "p/1"], A) == {"w/1": 0, "q/1": 0, "p/1": 0}
            client.register_script(holders.script(holders.SWAP))(KEYS, ["q/1"])
            assert await index.match(["w/1", "q/1", "p/1"], A) == {"w/1": 0, "q/1": 10, "p/1": 0}
            index.record("p/1", A[:3])
            await index.flush()
            assert await index.match(["w/1", "q/1", "p/1"], A) == {"w/1": 0, "q/1": 10, "p/1": 3}
    finally:
        await index.close()
