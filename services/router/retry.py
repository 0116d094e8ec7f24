"""Which worker a failed attempt blames, and whether the request may be placed again.

Only UNAVAILABLE moves a request (a worker gone, a prefill or KV transfer that failed, the first-token bound):
INVALID_ARGUMENT, RESOURCE_EXHAUSTED and the client's own deadline are answers, not faults of one worker. Before
any message reached the client the request is retried as it came; after, it migrates (services/router/migration.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import RouterConfig
from pdserve.errors import UnavailableError
from pdserve.registry.base import WorkerState
from services.router.placement import Placement


def blamed_worker(error: UnavailableError, placement: Placement) -> WorkerState:
    """The prefill worker when the decode worker's status (or the router's first-token bound) names its address,
    else the decode worker: the router could not reach it, or it failed on its own."""
    prefill = placement.prefill
    if prefill is not None and prefill.address in str(error):
        return prefill
    return placement.decode


@dataclass
class Moves:
    """How often one request was placed again: retries before its first message, migrations after."""

    retries: int = 0
    migrations: int = 0
    waited_for_room: bool = False  # a migration waited for a decode worker with room once (lifecycle.py)

    def allow(self, config: RouterConfig, sent: int, max_tokens: int, time_remaining: float | None) -> bool:
        """Counts the move when it is allowed. `sent`: tokens already streamed to the client (-1: none, not
        even a message without tokens, so the request may start over)."""
        if time_remaining is not None and time_remaining <= 0:
            return False
        if sent < 0:
            self.retries += 1
            return self.retries < config.max_attempts
        self.migrations += 1
        return self.migrations <= config.migration_limit and sent < max_tokens
