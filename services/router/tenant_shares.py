"""Which tenants hold more than their share of this router's streams, so a nearly full cluster keeps room for the
others (admission.py's fair-share reserve).

Admission answers at once, with no queue to reorder, so a tenant flooding the cluster would otherwise take every
place as it frees and shed the others as often as itself: capacity split by demand. A tenant is over its share
while it holds more of this router's in-flight streams than its share among the tenants active now (those with a
stream in flight here, or a request in the last ACTIVE_S: one shed at every try is still asking), shares split
by the key file's tenant weights (1 each unless [[tenants]] says). One tenant alone is never over: nobody is
waiting for what it leaves. Routers behind one Service see the same mix of
tenants, so each judging its own streams approximates the cluster's shares without a shared count.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

ACTIVE_S = 10.0


@dataclass(frozen=True)
class OverShare:
    """A tenant over its share: its streams here, all active tenants' streams here, and how many are active."""

    held: int
    total: int
    active: int


class TenantShares:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.weights: Mapping[str, float] = {}  # the key file's, kept current by its reloads; absent: 1
        self.in_flight: Counter[str] = Counter()
        self._asked_at: dict[str, float] = {}

    def asked(self, tenant: str) -> None:
        """A request of `tenant` arrived, admitted or not."""
        self._asked_at[tenant] = self.clock()

    def entered(self, tenant: str) -> None:
        self.in_flight[tenant] += 1

    def left(self, tenant: str) -> None:
        self.in_flight[tenant] -= 1
        if not self.in_flight[tenant]:
            del self.in_flight[tenant]
        self._asked_at[tenant] = self.clock()  # active ACTIVE_S past its last stream, as past its last request

    def over_share(self, tenant: str) -> OverShare | None:
        cutoff = self.clock() - ACTIVE_S
        self._asked_at = {t: at for t, at in self._asked_at.items() if at >= cutoff or t in self.in_flight}
        active = self._asked_at.keys() | self.in_flight.keys() | {tenant}
        if len(active) < 2:
            return None
        held, total = self.in_flight[tenant], sum(self.in_flight.values())
        weight, weights = self.weights.get(tenant, 1.0), sum(self.weights.get(t, 1.0) for t in active)
        return OverShare(held, total, len(active)) if held * weights > total * weight else None
