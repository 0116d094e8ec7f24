"""A router on another host, with its clock off (sitecustomize.py, PDSERVE_TEST_SKEWED_SCRIPT=other_router.py): it
shares a stream moving through it and a KV claim on decode worker d0 through Redis, as a live router does, with the
real SharedMoving and SharedKVClaims, both lapsing LAPSE_S on. Usage: other_router.py REDIS_URL LAPSE_S."""

from __future__ import annotations

import asyncio
import sys

from services.router.kv_claims import CLAIM_RETRY_HINTS, KVClaims
from services.router.load_tracker import LoadTracker
from services.router.shared_claims import SharedKVClaims
from services.router.shared_moving import LAPSE_INTERVALS, SharedMoving

MOVING = 3
CLAIMED_BLOCKS = 51


async def share(url: str, lapse_s: float) -> None:
    tracker = LoadTracker()
    tracker.moving = MOVING
    assert await SharedMoving(url, tracker, interval_s=lapse_s / LAPSE_INTERVALS).sync()
    claims = KVClaims()
    shared = SharedKVClaims(url, claims)
    claims.claim("d0", CLAIMED_BLOCKS, retry_after_s=lapse_s / CLAIM_RETRY_HINTS, after_s=0.0)
    assert await shared.sync()  # then it stops, as a router gone: its entries lapse


if __name__ == "__main__":
    asyncio.run(share(sys.argv[1], float(sys.argv[2])))
