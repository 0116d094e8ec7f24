"""A controller or router on another host, with its clock off (sitecustomize.py, PDSERVE_TEST_SKEWED_SCRIPT=
other_host.py), writing what the registry scores by time, with the real RedisRegistry and RedisPrefixIndex.
Usage: other_host.py retire REDIS_URL WORKER_ID | other_host.py place REDIS_URL CACHE_KEY MAX_BLOCKS HEX_HASH..."""

from __future__ import annotations

import asyncio
import sys

from pdserve.registry.redis import RedisRegistry
from pdserve.registry.redis_prefix import RedisPrefixIndex


async def place(url: str, cache_key: str, max_blocks: int, block_hashes: list[bytes]) -> None:
    index = RedisPrefixIndex(url, max_blocks_per_worker=max_blocks)
    index.record(cache_key, block_hashes)
    await index.close()  # once the write is done


if __name__ == "__main__":
    match sys.argv[1:]:
        case ["retire", url, worker_id]:
            RedisRegistry(url).retire(worker_id)
        case ["place", url, cache_key, max_blocks, *hashes]:
            asyncio.run(place(url, cache_key, int(max_blocks), [bytes.fromhex(h) for h in hashes]))
        case _:
            sys.exit(__doc__)
