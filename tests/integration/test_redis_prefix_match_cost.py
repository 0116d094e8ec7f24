"""What a prefix match costs Redis, against a real redis-server: a worker whose entry lacks the prompt's first block
costs one lookup, not the whole probe (at 128 prefill workers, where one in 16 held the prompt's first blocks, the probe
of every worker cost Redis ~4.7 ms and the router's loop ~12 ms a request, docs/experiments/router_at_scale/); and the
calls that ask it stay bounded however long the prompt, with the same hits counted."""

from __future__ import annotations

import pytest
import redis

from pdserve.engine.cache_journal import PrefixCacheChanges
from pdserve.protocol.prefix_hash import prefix_hashes
from pdserve.registry import redis_prefix
from pdserve.registry.redis_prefix import FIRST_PROBE_BLOCKS, RedisPrefixIndex, apply_changes, prefix_key
from tests.redis_server import emptied, started

pytestmark = pytest.mark.timeout(120)
BS = 16
server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)


def calls(client: redis.Redis, command: str) -> int:
    """How often Redis ran `command` so far, a script's own calls of it included."""
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_a_worker_that_lacks_the_prompts_first_block_costs_redis_one_lookup(url):
    prompt = prefix_hashes(list(range(FIRST_PROBE_BLOCKS * BS)), BS)  # one probe of 64 blocks
    keys = [f"w{i}/1" for i in range(40)]
    with redis.Redis.from_url(url) as client:
        apply_changes(client, "w0/1", PrefixCacheChanges(prompt[:10], [], whole=True))
        other = prefix_hashes(list(range(7, 7 + 64 * BS)), BS)  # another prompt's 64 blocks
        for key in keys[1:]:
            apply_changes(client, key, PrefixCacheChanges(other, [], whole=True))
        index = RedisPrefixIndex(url, match_budget_s=5.0)
        try:
            assert await index.match(keys[:1], prompt) == {"w0/1": 10}  # connected
            looked_up = calls(client, "zscore"), calls(client, "zmscore")
            hits = await index.match(keys, prompt)
            assert hits == {"w0/1": 10, **dict.fromkeys(keys[1:], 0)}
            # each worker's first block, and w0's whole probe: not 40 x 64 blocks
            assert (calls(client, "zscore") - looked_up[0], calls(client, "zmscore") - looked_up[1]) == (40, 1)
        finally:
            await index.close()


async def test_a_long_match_in_calls_of_few_lookups_counts_the_same_runs(url, monkeypatch):
    """16 lookups a call: each probe is asked in segments, one worker a call, and a run that ends at a segment's
    end, or at a gap in a later segment, counts as it does in one call; an entry that is no sorted set costs only its
    own worker's hits."""
    prompt = prefix_hashes(list(range(20 * FIRST_PROBE_BLOCKS * BS)), BS)  # 1280 blocks: probes of 64, 256, 960
    held = {
        "all/1": prompt,
        "gap-at-16/1": prompt[:16] + prompt[17:],  # the end of the first segment
        "gap-at-100/1": prompt[:100] + prompt[101:],
        "head/1": prompt[:FIRST_PROBE_BLOCKS],
        "from-1/1": prompt[1:],
        **{f"more{i}/1": prompt[: 5 * i] for i in range(1, 6)},
    }
    want = {
        "all/1": 1280,
        "gap-at-16/1": 16,
        "gap-at-100/1": 100,
        "head/1": 64,
        "from-1/1": 0,
        **{f"more{i}/1": 5 * i for i in range(1, 6)},
        "broken/1": 0,
        "none/1": 0,
    }
    with redis.Redis.from_url(url) as client:
        for key, blocks in held.items():
            apply_changes(client, key, PrefixCacheChanges(blocks, [], whole=True))
        client.set(prefix_key("broken/1"), "not a sorted set")
    index = RedisPrefixIndex(url, match_budget_s=5.0)
    try:
        assert await index.match(list(want), prompt) == want  # in one call a segment
        monkeypatch.setattr(redis_prefix, "LOOKUPS_PER_CALL", 16)
        assert await index.match(list(want), prompt) == want
        monkeypatch.setattr(redis_prefix, "LOOKUPS_PER_CALL", 100)  # 64 blocks, then segments of 100 of 256, 960
        assert await index.match(list(want), prompt) == want
    finally:
        await index.close()
