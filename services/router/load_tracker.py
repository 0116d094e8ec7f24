"""What this router has sent to each worker that the worker's last heartbeat cannot show yet, and what it has
seen finish since: a heartbeat taken before a prompt's first token came back still counts that prompt."""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict, deque

FORGET_AFTER_S = 60.0  # far older than any heartbeat a router still places by


class LoadTracker:
    def __init__(self) -> None:
        self.pending_prefill_tokens: Counter[str] = Counter()  # placed, first token not back yet
        self.pending_prefill_s: defaultdict[str, float] = defaultdict(float)  # the same, in predicted seconds
        self.pending_blocks: Counter[str] = Counter()  # KV blocks a decode worker is about to reserve
        self.decoding: Counter[str] = Counter()  # streams in flight per decode worker
        self._prefilled: defaultdict[str, deque[tuple[float, int]]] = defaultdict(deque)  # (wall time, tokens)
        # Requests not yet finished, per decode worker: placement number -> (wall time placed, KV blocks).
        self._placed: defaultdict[str, dict[int, tuple[float, int]]] = defaultdict(dict)
        self._placements = itertools.count()

    def start(self, prefill_id: str, decode_id: str, tokens: int, seconds: float, blocks: int) -> int:
        """Returns the placement's number, for `finished`."""
        self.pending_prefill_tokens[prefill_id] += tokens
        self.pending_prefill_s[prefill_id] += seconds
        self.pending_blocks[decode_id] += blocks
        self.decoding[decode_id] += 1
        placement = next(self._placements)
        self._placed[decode_id][placement] = (time.time(), blocks)
        return placement

    def prefilled(self, prefill_id: str, decode_id: str, tokens: int, seconds: float, blocks: int) -> None:
        """The first token is back (or the request ended before it): its prefill no longer queues."""
        self.pending_prefill_tokens[prefill_id] -= tokens
        self.pending_prefill_s[prefill_id] = max(0.0, self.pending_prefill_s[prefill_id] - seconds)
        self.pending_blocks[decode_id] -= blocks
        _log(self._prefilled[prefill_id], tokens)

    def prefilled_since(self, prefill_id: str, since: float) -> int:
        """Prompt tokens of ours whose prefill ended after wall time `since` (a heartbeat's)."""
        return sum(tokens for at, tokens in self._prefilled[prefill_id] if at > since)

    def placed_since(self, decode_id: str, since: float) -> int:
        """KV blocks of our unfinished requests placed on the decode worker after wall time `since` (a
        heartbeat's): reserved there after it sampled its free blocks, first token back or not. A finished
        request holds none, whether it reserved them or ended before (an idle worker samples no more)."""
        return sum(blocks for at, blocks in self._placed[decode_id].values() if at > since)

    def finished(self, decode_id: str, placement: int) -> None:
        self.decoding[decode_id] -= 1
        self._placed[decode_id].pop(placement, None)


def _log(entries: deque[tuple[float, int]], amount: int) -> None:
    """Appends (now, amount), forgetting what no heartbeat a router still places by can predate."""
    now = time.time()
    entries.append((now, amount))
    while entries and entries[0][0] < now - FORGET_AFTER_S:
        entries.popleft()
