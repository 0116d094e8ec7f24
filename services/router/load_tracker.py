"""What this router has sent to each worker that the worker's last heartbeat cannot show yet."""

from __future__ import annotations

from collections import Counter, defaultdict


class LoadTracker:
    def __init__(self) -> None:
        self.pending_prefill_tokens: Counter[str] = Counter()  # placed, first token not back yet
        self.pending_prefill_s: defaultdict[str, float] = defaultdict(float)  # the same, as predicted compute
        self.pending_blocks: Counter[str] = Counter()  # KV blocks a decode worker is about to reserve
        self.decoding: Counter[str] = Counter()  # streams in flight per decode worker

    def start(self, prefill_id: str, decode_id: str, tokens: int, seconds: float, blocks: int) -> None:
        self.pending_prefill_tokens[prefill_id] += tokens
        self.pending_prefill_s[prefill_id] += seconds
        self.pending_blocks[decode_id] += blocks
        self.decoding[decode_id] += 1

    def prefilled(self, prefill_id: str, decode_id: str, tokens: int, seconds: float, blocks: int) -> None:
        """The first token is back (or the request ended before it): its prefill no longer queues."""
        self.pending_prefill_tokens[prefill_id] -= tokens
        self.pending_prefill_s[prefill_id] = max(0.0, self.pending_prefill_s[prefill_id] - seconds)
        self.pending_blocks[decode_id] -= blocks

    def finished(self, decode_id: str) -> None:
        self.decoding[decode_id] -= 1
