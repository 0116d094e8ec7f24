"""What a prefix match costs Redis, against a real redis-server: the bitmaps of the probe's blocks read once, however
many workers hold them, and no further than the block where the last asked worker's run ended (at 128 prefill
workers all holding a shared system prompt, looking up each holder's probe cost Redis ~8 ms a request,
docs/experiments/router_at_scale/); and the calls that ask it stay bounded however long the prompt, with the same
hits counted."""

from __future__ import annotations

import pytest
import redis

from pdserve.engine.cache_journal import PrefixCacheChanges
from pdserve.protocol.prefix_hash import prefix_hashes
from pdserve.registry import redis_prefix
from pdserve.registry.prefix_holders import SLOTS_KEY
from pdserve.registry.redis_prefix import FIRST_PROBE_BLOCKS, RedisPrefixIndex, apply_changes
from tests.redis_server import emptied, started

pytestmark = pytest.mark.timeout(120)
BS = 16
server = pytest.fixture(scope="module")(started)
url = pytest.fixture(emptied)


def calls(client: redis.Redis, command: str) -> int:
    """How often Redis ran `command` so far, a script's own calls of it included."""
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_a_match_reads_the_probes_blocks_once_however_many_workers_hold_them(url):
    """40 workers all hold the first 64 of a 1280-block prompt's blocks: with their slots read before (and kept while
    no mapping changes), the first round reads the 64 blocks' bitmaps (one HMGET), the second the next 64 blocks'
    only (its AND is empty at the first: a worker not asked, holding them all, does not keep it going), not 40
    workers' lookups of 64 blocks each; one worker holding 10 of another prompt's costs the same."""
    prompt = prefix_hashes(list(range(20 * FIRST_PROBE_BLOCKS * BS)), BS)  # probes of 64, then 256
    keys = [f"w{i}/1" for i in range(40)]
    with redis.Redis.from_url(url) as client:
        apply_changes(client, "unasked/1", PrefixCacheChanges(prompt, [], whole=True))  # holds on, but is not asked
        for key in keys:
            apply_changes(client, key, PrefixCacheChanges(prompt[:FIRST_PROBE_BLOCKS], [], whole=True))
        other = prefix_hashes(list(range(7, 7 + 64 * BS)), BS)
        apply_changes(client, "x/1", PrefixCacheChanges(other[:10], [], whole=True))
        index = RedisPrefixIndex(url, match_budget_s=5.0)
        try:
            assert await index.match([*keys, "x/1"], prompt[:1]) == {**dict.fromkeys(keys, 1), "x/1": 0}  # slots read
            commands = ("hmget", "zscore", "zmscore")
            for probe, want in ((prompt, dict.fromkeys(keys, 64)), (other, {**dict.fromkeys(keys, 0), "x/1": 10})):
                looked_up = [calls(client, c) for c in commands]
                assert await index.match(list(want), probe) == want
                rounds = 2 if probe is prompt else 1  # a round's bitmaps: no slot mapping read, no worker's own lookup
                assert [calls(client, c) - n for c, n in zip(commands, looked_up, strict=True)] == [rounds, 0, 0]
        finally:
            await index.close()


async def test_a_long_match_in_calls_of_few_lookups_counts_the_same_runs(url, monkeypatch):
    """16 lookups a call: each probe is asked in segments, and a run that ends at a segment's end, or at a gap in a
    later segment, counts as it does in one call; a slot mapping that does not parse costs only its own worker's
    hits."""
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
        client.hset(SLOTS_KEY, "broken/1", "not a slot")  # a mapping that does not parse
    index = RedisPrefixIndex(url, match_budget_s=5.0)
    try:
        assert await index.match(list(want), prompt) == want  # in one call a segment
        monkeypatch.setattr(redis_prefix, "LOOKUPS_PER_CALL", 16)
        assert await index.match(list(want), prompt) == want
        monkeypatch.setattr(redis_prefix, "LOOKUPS_PER_CALL", 100)  # 64 blocks, then segments of 100 of 256, 960
        assert await index.match(list(want), prompt) == want
    finally:
        await index.close()
