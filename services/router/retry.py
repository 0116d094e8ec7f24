"""Which worker a failed attempt blames, and whether the request may be placed again.

Only UNAVAILABLE is retried (a worker gone, a prefill or KV transfer that failed, the first-token bound), and
only before any message reached the client: INVALID_ARGUMENT, RESOURCE_EXHAUSTED and the client's own deadline
are answers, not faults of one worker.
"""

from __future__ import annotations

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


def may_retry(attempt: int, max_attempts: int, sent_anything: bool, time_remaining: float | None) -> bool:
    """`attempt`: the one that just failed (1-based)."""
    in_time = time_remaining is None or time_remaining > 0
    return not sent_anything and attempt < max_attempts and in_time
