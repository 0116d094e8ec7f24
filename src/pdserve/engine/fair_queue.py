"""The order a worker takes waiting prompts in: higher priority first; within a priority, each tenant's in turn.

First come, first served let a tenant that queued a hundred prompts delay another tenant's one by all of them,
however fairly the router admitted both. Start-time fair queuing by prompt tokens instead: a prompt's tag starts
where its tenant's previous prompt's ended (its new tokens later), or at the queue's virtual time if that is
later, and the lowest tag goes first. A tenant with one prompt waiting so goes next to the one with a hundred,
not behind them; one tenant alone (or requests of no tenant) at one priority is served exactly first come,
first served.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from pdserve.engine.sequence import Sequence


class FairQueue:
    def __init__(self) -> None:
        self._virtual = 0.0  # the start tag of the prompt taken last
        self._ends: dict[str, float] = {}  # per tenant: where its last tagged prompt's tokens end
        self._arrivals = itertools.count()

    def tag(self, seq: Sequence) -> None:
        """Gives a newly waiting prompt its place among its tenant's and the others'."""
        start = max(self._virtual, self._ends.get(seq.tenant, 0.0))
        self._ends[seq.tenant] = start + max(1, seq.num_tokens - seq.expected_cached_tokens)
        seq.queue_tag = (start, next(self._arrivals))

    def first(self, waiting: Iterable[Sequence]) -> Sequence:
        """The prompt to take next of `waiting` (the scheduler takes a preempted one back first, but below a higher
        priority)."""
        return min(waiting, key=lambda s: (-s.priority, s.queue_tag))

    def taken(self, seq: Sequence) -> None:
        """`seq` left the queue to run: the queue's virtual time moves to its start, and tenants whose prompts
        all start before it are forgotten (a new prompt of theirs starts at the virtual time anyway)."""
        if seq.queue_tag[0] > self._virtual:
            self._virtual = seq.queue_tag[0]
            self._ends = {t: end for t, end in self._ends.items() if end > self._virtual}
