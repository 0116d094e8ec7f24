"""Redis's clock, for times the routers share through Redis (a KV claim's lapse, a moving count's): each router writes
and reads them in Redis's `TIME`, read in the same transaction as the entries, so no router's clock is ever compared
with another's. (The quotas' Lua scripts read `TIME` themselves; a worker's registry entry is aged by its TTL.)"""

from __future__ import annotations


class RedisClock:
    """Redis's time as last read, carried on a local clock between reads (the caller's: the one its own deadlines
    are on) for what it writes before its next read."""

    def __init__(self) -> None:
        self._offset: float | None = None  # Redis's time less the local clock's, at the last read

    def read(self, answer: tuple[int, int], local_now: float) -> float:
        """`TIME`'s answer (seconds, microseconds) in a transaction whose answer came at `local_now`: Redis's time
        then, in seconds (late by the answer's way back)."""
        now = answer[0] + answer[1] / 1e6
        self._offset = now - local_now
        return now

    def at(self, local: float) -> float | None:
        """Redis's time at `local` on the local clock, as the last read carries it; None before any read."""
        return None if self._offset is None else local + self._offset
