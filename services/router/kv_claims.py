"""A bound on how long a large request waits for a decode worker's KV room, as an engine's waiting queue would give.

Admission sheds a request that no decode worker has the free blocks for, with a retry hint. Without a claim, the blocks
that free up meanwhile go to whichever smaller request comes next, so a large request (a long prompt, a large
max_tokens) can be refused for as long as small ones keep coming. A request refused for longer than its TTFT SLO
therefore claims its blocks on the worker it was placed on, if that worker could ever hold it: until the claim lapses, a
smaller new request is placed there only on the blocks beyond the claim, so the free blocks add up to what the claimant
needs. Not at its first refusal: a claim holds blocks back from every smaller request (under a sustained overload with
one request in eight large, claims at the first refusal cut the large ones' longest wait from 146 to 15 s but raised the
small ones' median from 0.3 to 2.7 s), so it is kept for a request that has already missed its first-token SLO, which
only a claim can bound. A worker holds one claim: the one of the claimant refused first, so starved requests get in in
the order they came (a later claimant's claim there gives way to an earlier one's). Requests are known by their size: a
refusal of a request as large as a live claim (the claimant's own retry: the same prompt and max_tokens, the same number
of blocks) renews that claim wherever it is, so one claimant holds one claim however its retries are placed; a request
at least as large admitted anywhere ends it. A claimant whose claim ended so, or gave way, keeps its place: its next
refusal claims again at once, as early as it first was. A claim the claimant does not come back for lapses after a few
of its retry hints. Streams moving to another decode worker are mid-answer and never wait on a claim. Routers that share
a Redis registry share their claims (shared_claims.py): each writes the claims it set, renewed or ended, and takes every
router's, so a claim holds against every router's requests and a claimant's retries renew it through whichever router
they reach. A request's refusals are counted by the router they reach.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

CLAIM_MIN_S = 1.0
CLAIM_RETRY_HINTS = 4  # a claim outlasts this many of its claimant's retry hints, for retries that come late


@dataclass
class Claim:
    blocks: int
    until: float  # on KVClaims.clock
    since: float  # when its claimant was first refused, on KVClaims.clock: the earliest holds the worker


@dataclass
class Refused:
    """A request of one size refused for room and retrying: since when, and until when it is waited for."""

    since: float
    until: float
    called_until: float = 0.0  # a request of its size was told to come back for its claim by then (one at a time)


class KVClaims:
    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock or (lambda: time.monotonic())  # looked up per call: tests move it by hand
        self._claims: dict[str, Claim] = {}  # decode worker id -> the live claim on it
        self._refused: dict[int, Refused] = {}  # blocks -> the first refusal of a request that size
        self.shared = False  # set by shared_claims.py, which takes the changes: none are kept for no one to take
        self._changed: set[str] = set()  # workers whose claim this router set, renewed or ended since the last take

    def claim(self, worker_id: str, blocks: int, retry_after_s: float, after_s: float) -> bool:
        """A request needing `blocks` was refused for room on the worker (one whose whole KV holds it). A live claim
        of its size is renewed, wherever it is; else, once requests of its size have been refused for `after_s`
        (its TTFT SLO), it claims them there, unless a request refused before it holds the worker's claim. True when
        this request is the one a live claim of its size calls back at `retry_after_s`: one per such hint, as the blocks
        are kept for one request; the others of its size are told to come back later (retry_pacing.py)."""
        now = self.clock()
        self._claims = {w: c for w, c in self._claims.items() if c.until > now}  # a gone worker's lapse too
        self._refused = {b: r for b, r in self._refused.items() if r.until > now}
        until = now + max(CLAIM_MIN_S, CLAIM_RETRY_HINTS * retry_after_s)
        refused = self._refused.setdefault(blocks, Refused(now, until))  # kept while claimed: its place, if it ends
        refused.until = max(refused.until, until)
        renewed = [w for w, held in self._claims.items() if held.blocks == blocks]
        for w in renewed:
            self._claims[w].until = until
        self._mark(renewed)
        if not renewed and now - refused.since >= after_s:
            held = self._claims.get(worker_id)
            if held is None or refused.since < held.since:
                self._claims[worker_id] = Claim(blocks, until, refused.since)
                self._mark([worker_id])
                renewed = [worker_id]
        if not renewed or refused.called_until > now:
            return False
        refused.called_until = now + retry_after_s
        return True

    def expect(self, blocks: int, retry_after_s: float) -> None:
        """A request needing `blocks`, refused for room, was told to come back in `retry_after_s` (a later hint than
        its claim's): its size's wait is remembered until a few such hints past, so that it can still claim."""
        if (refused := self._refused.get(blocks)) is not None:
            refused.until = max(refused.until, self.clock() + CLAIM_RETRY_HINTS * retry_after_s)

    def held_from(self, worker_id: str, blocks: int) -> int:
        """The worker's free blocks a new request needing `blocks` must leave to a claim: all the claim's, unless it
        is at least as large as the claimant."""
        held = self._live(worker_id)
        return held.blocks if held is not None and blocks < held.blocks else 0

    def admitted(self, blocks: int) -> None:
        """A request needing `blocks` was admitted, on whichever worker: it ends every claim it is as large as
        (its own, placed elsewhere by an earlier retry, among them), and the wait of requests its size."""
        ended = [w for w, c in self._claims.items() if c.blocks <= blocks]
        for w in ended:
            del self._claims[w]
        self._mark(ended)
        self._refused.pop(blocks, None)

    def take_changes(self) -> dict[str, Claim | None]:
        """What this router changed since the last take, for the other routers: each such worker's live claim, or
        None where it ended."""
        changed, self._changed = self._changed, set()
        return {w: self._live(w) for w in changed}

    def put_back(self, workers: set[str]) -> None:
        """Changes taken but not written (the shared store did not answer): taken again, as they are then."""
        self._changed |= workers

    def merge(self, shared: dict[str, Claim]) -> None:
        """Every router's claims, as the shared store held them, in place of this router's view; a claim this
        router changed since its last take stays as it is here, to be written next."""
        mine = {w: self._claims.get(w) for w in self._changed}
        self._claims = {w: c for w, c in shared.items() if w not in mine}
        self._claims.update({w: c for w, c in mine.items() if c is not None})

    def _mark(self, workers: list[str]) -> None:
        if self.shared:
            self._changed.update(workers)

    def _live(self, worker_id: str) -> Claim | None:
        held = self._claims.get(worker_id)
        if held is not None and held.until <= self.clock():
            del self._claims[worker_id]
            return None
        return held
