"""Which worker a failed attempt blames, whether the request may be placed again, and the record of a move.

UNAVAILABLE moves a request (a worker gone, a prefill or KV transfer that failed, the first-token bound), and so
does a decode worker's refusal as full (RESOURCE_EXHAUSTED) when the router saw room there (another router's stream
took it): that one to a worker with room only, the full one not ejected. INVALID_ARGUMENT, other RESOURCE_EXHAUSTED
and the client's own deadline are answers, not faults of one worker. Before any message reached the client the
request is retried as it came; after, it migrates (services/router/migration.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

from opentelemetry import trace

from pdserve.config import RouterConfig
from pdserve.errors import ClusterAuthError, OverloadedError, UnavailableError
from pdserve.metrics import RouterMetrics
from pdserve.registry.base import Registry, WorkerState
from services.router.placement import Placement
from services.router.relay import NoFirstTokenError
from services.router.stall import StalledError
from services.router.unlisted import UnlistedError

log = logging.getLogger(__name__)
# Why the router took a worker out of placement (pdserve_worker_ejections_total's `reason`), a fixed set: a call that
# failed UNAVAILABLE (the worker gone, unreachable, or its engine or KV transfer failed), the router's first-token
# or stall bound, a placed worker the registry no longer lists before the first token (services/router/unlisted.py),
# a worker refusing the router's cluster credentials, and a drain (services/router/drain.py).
EJECTION_REASONS = ("unavailable", "no_first_token", "stalled", "unlisted", "cluster_auth", "draining")


def blamed_worker(error: UnavailableError | OverloadedError, placement: Placement) -> WorkerState:
    """The prefill worker when the decode worker's status (or the router's first-token bound) names its address,
    as a whole address (not inside another host's name), else the decode worker: the router could not reach it,
    or it failed on its own."""
    prefill = placement.prefill
    if prefill is not None and re.search(rf"(?<![\w.\-]){re.escape(prefill.address)}(?!\w)", str(error)):
        return prefill
    return placement.decode


def ejection_reason(error: UnavailableError | OverloadedError) -> str:
    """The failed attempt's reason, of EJECTION_REASONS, for ejecting the worker it blamed."""
    for kind, reason in ((NoFirstTokenError, "no_first_token"), (StalledError, "stalled"), (UnlistedError, "unlisted")):
        if isinstance(error, kind):
            return reason
    return "cluster_auth" if isinstance(error, ClusterAuthError) else "unavailable"


def avoided_workers(
    blamed: WorkerState, placement: Placement, error: UnavailableError | OverloadedError
) -> list[WorkerState]:
    """The workers a failed attempt's request avoids from then on: the blamed one, and with a prefill worker blamed
    the decode worker too, since its own fault reads the same from here (a KV transfer it could not receive, a hang
    after it called the prefill worker) and its retries would keep going back to it, unless the registry itself
    named the prefill worker gone (UnlistedError). Only the blamed one is ejected; a request with no other worker
    left still goes back to them (lifecycle.py)."""
    if blamed is placement.prefill and not isinstance(error, UnlistedError):
        return [blamed, placement.decode]
    return [blamed]


class FailedWorkers:
    """The workers that failed one request: each at the address it failed at, as the registry listed it then (its
    last heartbeat's `updated_at`, the worker's own clock, compared with nothing: any other value is a later
    heartbeat, even one that clock stepped back for), and whether by a fault (not only refused it as full). One
    listed again at another address is a new process (Ray restarted it, a new pod took its id), and one heard from
    twice since is alive: a moving stream may go back to either (lifecycle.py).
    Twice: a view refreshed just before the failure may bring one heartbeat sent before it, from a dead worker."""

    def __init__(self) -> None:
        self._at: dict[str, tuple[str, float, bool]] = {}  # worker id -> (address, updated_at, fault)
        self._heard: dict[str, set[float]] = {}  # worker id -> the other `updated_at`s seen since its failure
        self.waited_s = 0.0  # for one of them to be heard from or restarted, over all the request's moves

    def add(self, workers: Iterable[WorkerState], registry: Registry, fault: bool) -> None:
        listed = {w.worker_id: w for w in registry.workers()}
        for w in workers:
            seen = listed.get(w.worker_id, w)
            before = self._at.get(w.worker_id)
            faulted = fault or (before is not None and before[0] == w.address and before[2])  # a restart starts clean
            self._at[w.worker_id] = (w.address, seen.updated_at if seen.address == w.address else 0.0, faulted)
            self._heard[w.worker_id] = set()

    def ids(self) -> frozenset[str]:
        return frozenset(self._at)

    def unheard(self, registry: Registry) -> frozenset[str]:
        """Those that failed it by a fault and have not been heard from twice since at the address they failed at
        (dead, hung or unlisted), not restarted at another. Each call records the heartbeats it sees: a wait asks
        again and again (lifecycle.py), and two must be seen apart."""
        listed = {w.worker_id: w for w in registry.workers()}
        unheard = []
        for worker_id, (address, updated_at, fault) in self._at.items():
            now = listed.get(worker_id)
            if not fault or (now is not None and now.address != address):
                continue
            if now is not None and now.updated_at != updated_at:
                self._heard[worker_id].add(now.updated_at)
            if len(self._heard[worker_id]) < 2:
                unheard.append(worker_id)
        return frozenset(unheard)


@dataclass
class Moves:
    """How often one request was placed again: retries before its first message, migrations after."""

    retries: int = 0
    migrations: int = 0
    waited_for_room: bool = False  # a migration waited for a decode worker with room once (lifecycle.py)
    room_hint_s: float = 0.0  # the retry hint of the decode worker that last refused the moving stream for room

    def room_wait_s(self, most_s: float, left_s: float | None) -> float:
        """How long the next move waits before it is placed: the last refusal's hint, at most `most_s` and the
        caller's time left, once."""
        wait_s = min(self.room_hint_s, most_s if left_s is None else min(most_s, left_s))
        self.room_hint_s = 0.0
        return wait_s

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


def record_move(
    metrics: RouterMetrics,
    worker: WorkerState,
    error: UnavailableError | OverloadedError,
    placement: Placement,
    attempt: int,
    key: str,
    sent: int | None,
) -> None:
    """A `retry` or `migration` event on the request's span, its `attempts` and the workers it is on now, and one
    log line."""
    kind = "retry" if sent is None else "migration"
    attrs: dict[str, str | int] = {"attempt": attempt, "failed.worker.id": worker.worker_id, "error": str(error)}
    attrs["prefill.worker.id"] = placement.prefill_worker.worker_id
    attrs["decode.worker.id"] = placement.decode.worker_id
    if sent is not None:
        attrs["streamed_tokens"] = sent
    metrics.moves.add(1, {"kind": kind})
    span = trace.get_current_span()
    span.add_event(kind, attrs)
    span.set_attribute("attempts", attempt)
    span.set_attribute("prefill.worker.id", placement.prefill_worker.worker_id)
    span.set_attribute("decode.worker.id", placement.decode.worker_id)
    verb = "placed again" if sent is None else f"migrated after {sent} streamed tokens"
    if isinstance(error, OverloadedError):  # full, not failed: a race between routers, not a fault
        log.info("request %s: worker %s was full", verb, worker.worker_id, extra=attrs | {"key": key})
        return
    log.warning("request %s after worker %s failed it", verb, worker.worker_id, extra=attrs | {"key": key})
