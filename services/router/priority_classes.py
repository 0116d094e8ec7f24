"""Which priority classes are active, so a nearly full cluster keeps room for the ones above a request's
(admission.py's priority reserve).

Admission answers at once, with no queue to reorder, so without a reserve a flood at priority 0 takes each decode
place as it frees and a priority 5 request is shed as often as the flood is (a review's run: 62% of them). The
classes are the queue bound's: above 0, 0, below 0. A class is active while it has a stream in flight here or
sent a request in the last ACTIVE_S (one shed at every try is still asking); only then do the classes below leave
it room, so a cluster that never sets a priority loses nothing.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from services.router.tenant_shares import ACTIVE_S


def priority_class(priority: int) -> int:
    """1 above the normal priority, 0 for it, -1 below."""
    return (priority > 0) - (priority < 0)


class PriorityClasses:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.in_flight: Counter[int] = Counter()  # by class
        self._asked_at: dict[int, float] = {}

    def asked(self, priority: int) -> None:
        """A request of `priority` arrived, admitted or not."""
        self._asked_at[priority_class(priority)] = self.clock()

    def entered(self, priority: int) -> None:
        self.in_flight[priority_class(priority)] += 1

    def left(self, priority: int) -> None:
        level = priority_class(priority)
        self.in_flight[level] -= 1
        self._asked_at[level] = self.clock()  # active ACTIVE_S past its last stream, as past its last request

    def higher_active(self, priority: int) -> bool:
        """A class above `priority`'s has a stream in flight here, or asked within ACTIVE_S."""
        cutoff = self.clock() - ACTIVE_S
        level = priority_class(priority)
        return any(
            self.in_flight[above] > 0 or self._asked_at.get(above, -float("inf")) >= cutoff
            for above in range(level + 1, 2)
        )
