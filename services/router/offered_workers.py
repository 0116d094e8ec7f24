"""The workers a request's offer is judged over (placement.Offer): what the cluster could do for it were it idle,
which admission refuses as never servable (INVALID_ARGUMENT) when the request asks for more.

Every registered worker counts, ejected and draining ones too, and so does one gone from the registry, at its last
state, until the router forgets it (gone_workers.py: missing for GONE_AFTER_S, 5 min). A worker that died leaves the
registry until its restart serves again (its supervisor unlists it). Without it, what only it could serve (a
max_tokens past the other decode workers' KV, n choices the whole fleet holds together, an SLO only it meets idle)
would be refused as never servable for as long as it restarts; a soak saw n=2 answered 400 for each decode worker's
~10 s restart. With it, such a request is shed with a retry hint, which a retry after the restart meets. A worker
removed for good (a scale-down retires its id in the registry) stops counting at once: what only it could serve
is invalid from then on, not shed for minutes (unless Redis was down as it left: then it counts as gone).
"""

from __future__ import annotations

from pdserve.protocol.roles import Role
from pdserve.registry.base import Registry, WorkerState


class OfferedWorkers:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._last: dict[str, WorkerState] = {}  # worker id -> its last state seen (its role: the last it had)

    def workers(self, role: Role) -> list[WorkerState]:
        """The registered workers of `role`, then those last seen in it, gone from the registry, neither retired nor
        forgotten."""
        listed = list(self._registry.workers(role))
        self._last.update((w.worker_id, w) for w in listed)
        left = {w.worker_id for w in listed} | self._registry.retired()
        return listed + [w for w in self._last.values() if w.role == role and w.worker_id not in left]

    def worker_ids(self) -> set[str]:
        return set(self._last)

    def forget(self, worker_id: str) -> bool:
        self._last.pop(worker_id, None)
        return True
