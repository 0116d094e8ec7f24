"""First come, first served for a decode worker's KV room, as an engine's waiting queue would give it.

Admission sheds a request that no decode worker has the free blocks for, with a retry hint. Without a claim, the
blocks that free up meanwhile go to whichever smaller request comes next, so a large request (a long prompt, a
large max_tokens) can be refused for as long as small ones keep coming. A refused request therefore claims its
blocks on the worker it was placed on: until the claim lapses, a smaller new request is placed there only on the
blocks beyond it, so the free blocks add up to what the claimant needs. A retry of the claimant (the same prompt
and max_tokens: the same number of blocks) renews the claim; a request at least as large takes the blocks and ends
it. A claim the claimant does not come back for lapses after a few of its retry hints. Streams moving to another
decode worker are mid-answer and never wait on a claim. Claims are this router's own: another router's requests
do not see them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

CLAIM_MIN_S = 1.0
CLAIM_RETRY_HINTS = 4  # a claim outlasts this many of its claimant's retry hints, for retries that come late


@dataclass
class Claim:
    blocks: int
    until: float  # time.monotonic()


class KVClaims:
    def __init__(self) -> None:
        self._claims: dict[str, Claim] = {}  # decode worker id -> the oldest live claim on it

    def claim(self, worker_id: str, blocks: int, retry_after_s: float) -> None:
        """A request needing `blocks` was refused for room on the worker: it claims them there unless an earlier
        one did (its own earlier refusal renews the claim)."""
        now = time.monotonic()
        self._claims = {w: c for w, c in self._claims.items() if c.until > now}  # a gone worker's lapse too
        held = self._claims.get(worker_id)
        if held is None or held.blocks == blocks:
            self._claims[worker_id] = Claim(blocks, now + max(CLAIM_MIN_S, CLAIM_RETRY_HINTS * retry_after_s))

    def held_from(self, worker_id: str, blocks: int) -> int:
        """The worker's free blocks a new request needing `blocks` must leave to a claim: all the claim's, unless it
        is at least as large as the claimant."""
        held = self._live(worker_id)
        return held.blocks if held is not None and blocks < held.blocks else 0

    def admitted(self, worker_id: str, blocks: int) -> None:
        """A request needing `blocks` was admitted on the worker: one at least as large as the claimant ends it."""
        held = self._live(worker_id)
        if held is not None and blocks >= held.blocks:
            del self._claims[worker_id]

    def _live(self, worker_id: str) -> Claim | None:
        held = self._claims.get(worker_id)
        if held is not None and held.until <= time.monotonic():
            del self._claims[worker_id]
            return None
        return held
