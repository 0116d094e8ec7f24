"""A placed worker leaving the registry while its request waits for the first token.

The launcher's supervision takes a stuck or dead worker out of the registry within a few seconds (a Redis entry
whose heartbeats stop expires with its TTL); a request already placed on it would wait for gRPC keepalive (about
15 s, a SIGSTOPped process's connection stays open) or the first-token bound to notice. Nothing reached the caller
yet, so the router cancels that attempt once a worker of its placement is listed no more (or at another address:
a new process) and another worker of its role serves, and places the request again, as after any failed attempt. A
draining worker stays listed: its requests finish there. A registry view kept through an outage says nothing about
who is gone: no attempt is cut on it.
"""

from __future__ import annotations

import asyncio

from pdserve.errors import UnavailableError
from pdserve.protocol.roles import Role
from pdserve.registry.base import Registry, WorkerState
from services.router.placement import Placement

CHECK_S = 0.25  # as often as a remote registry's view is refreshed (registry.base.VIEW_REFRESH_S)


class UnlistedError(UnavailableError):
    """A placed worker left the registry before the first token: the router's ejection counts it as `unlisted`."""


class Listing:
    """Which workers the registry lists, read once per check for every request waiting on a first token."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._read_at = -1.0
        self._listed: frozenset[tuple[str, str]] = frozenset()
        self._serving: frozenset[Role] = frozenset()  # roles with a worker listed and not draining

    def gone(self, placement: Placement) -> WorkerState | None:
        """The placement's prefill worker, else its decode worker, that the registry lists no more at the address
        it was placed at while another worker of its role serves; None otherwise, or when the view is not current.
        The last of a role stays (as the supervision never unlists it for silence alone): a worker starved of CPU
        past the registry's TTL is as likely as a stuck one, and its request has nowhere else to go."""
        if not self.registry.view_current():
            return None
        now = asyncio.get_running_loop().time()
        if now - self._read_at >= CHECK_S:
            listed = self.registry.workers()
            self._listed = frozenset((w.worker_id, w.address) for w in listed)
            self._serving = frozenset(w.role for w in listed if not w.draining)
            self._read_at = now
        for worker in (placement.prefill, placement.decode):
            if worker is None or (worker.worker_id, worker.address) in self._listed:
                continue
            if worker.role in self._serving:
                return worker
        return None


class UnlistedCheck:
    """Expires `timeout` once a worker of `placement` is gone from `listing`, checked every CHECK_S."""

    def __init__(self, timeout: asyncio.Timeout, listing: Listing, placement: Placement) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout, self._listing, self._placement = timeout, listing, placement
        self.gone: WorkerState | None = None
        self._handle = self._loop.call_later(CHECK_S, self._check)

    def _check(self) -> None:
        self.gone = self._listing.gone(self._placement)
        if self.gone is None:
            self._handle = self._loop.call_later(CHECK_S, self._check)
        else:
            self._timeout.reschedule(self._loop.time())  # the read is cancelled: TimeoutError

    def cancel(self) -> None:
        self._handle.cancel()

    def error(self) -> UnlistedError:
        assert self.gone is not None
        p, worker = self._placement, self.gone
        role = "prefill" if worker is p.prefill else "decode"
        return UnlistedError(
            f"{role} worker {worker.worker_id} at {worker.address} left placement before the first token (the "
            "registry lists it no more: stuck, dead or restarting); the request was cancelled there"
        )
