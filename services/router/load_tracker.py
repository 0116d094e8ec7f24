"""What this router has sent to each worker that the worker's last heartbeat cannot show yet, and what it has
seen finish since: a heartbeat taken before a prompt's first token came back still counts that prompt."""

from __future__ import annotations

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
        self._placed: defaultdict[str, deque[tuple[float, int]]] = defaultdict(deque)  # (wall time, KV blocks)

    def start(self, prefill_id: str, decode_id: str, tokens: int, seconds: float, blocks: int) -> None:
        self.pending_prefill_tokens[prefill_id] += tokens
        self.pending_prefill_s[prefill_id] += seconds
        self.pending_blocks[decode_id] += blocks
        self.decoding[decode_id] += 1
        _log(self._placed[decode_id], blocks)

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
        """KV blocks of ours placed on the decode worker after wall time `since` (a heartbeat's): reserved there
        after it sampled its free blocks, first token back or not."""
        return sum(blocks for at, blocks in self._placed[decode_id] if at > since)

    def finished(self, decode_id: str) -> None:
        self.decoding[decode_id] -= 1


def _log(entries: deque[tuple[float, int]], amount: int) -> None:
    """Appends (now, amount), forgetting what no heartbeat a router still places by can predate."""
    now = time.time()
    entries.append((now, amount))
    while entries and entries[0][0] < now - FORGET_AFTER_S:
        entries.popleft()
