"""The workers a request's offer is judged over (placement.Offer): what the cluster could do for it were it idle,
which admission refuses as never servable (INVALID_ARGUMENT) when the request asks for more.

Every registered worker counts, ejected and draining ones too, and so does one gone from the registry, at its last
state, until the router forgets it (gone_workers.py: missing for GONE_AFTER_S, 5 min). A worker that died leaves the
registry until its restart serves again (its supervisor unlists it). Without it, what only it could serve (a
max_tokens past the other decode workers' KV, n choices the whole fleet holds together, an SLO only it meets idle)
would be refused as never servable for as long as it restarts; a soak saw n=2 answered 400 for each decode worker's
~10 s restart. With it, such a request is shed with a retry hint, which a retry after the restart meets. A worker
removed for good (a scale-down) counts as long, so for those minutes such a request is shed where it is invalid.
"""

from __future__ import annotations

from pdserve.protocol.roles import Role
from pdserve.registry.base import Registry, WorkerState


class OfferedWorkers:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._last: dict[Role, dict[str, WorkerState]] = {}  # role -> worker id -> its last state seen

    def workers(self, role: Role) -> list[WorkerState]:
        """The registered workers of `role`, then those gone from the registry and not forgotten yet."""
        listed = list(self._registry.workers(role))
        last = self._last.setdefault(role, {})
        last.update((w.worker_id, w) for w in listed)
        registered = {w.worker_id for w in listed}
        return listed + [w for worker_id, w in last.items() if worker_id not in registered]

    def worker_ids(self) -> set[str]:
        return set().union(*self._last.values())

    def forget(self, worker_id: str) -> bool:
        for last in self._last.values():
            last.pop(worker_id, None)
        return True
