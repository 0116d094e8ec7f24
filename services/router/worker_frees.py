"""Whether a decode worker's report was sampled before or after a stream's blocks were freed there, from the worker's
own count of the sequences its engine freed: the report says the count it was sampled at, the stream's end the count
once its blocks were free. A router's clock cannot tell: a stream that ended on its worker just before a report may
reach the router after it (its last message in flight, a busy loop), and counted back then its blocks would be free
twice in the router's estimate (once in the report, once counted back)."""

from __future__ import annotations

from typing import NamedTuple

from pdserve.rpc.metadata import SEQUENCES_FREED_KEY

# The trailing metadata a stream's call ended with: (key, value) pairs, or None where it ended otherwise.
Trailing = tuple[tuple[str, str | bytes], ...] | None


class FreedAt(NamedTuple):
    """A stream's end as its decode worker's process (`WorkerState.instance`) counted it: the `nth` sequence it freed.
    A report of that process sampled at `sequences_freed` >= `nth` shows its blocks free; one of another process
    (a restart, which counts from 0 again) never held them: a view of the worker older than the restart placed the
    stream, and at worst its blocks stay uncounted until a report of its own process. A tuple: read at every
    placement for each stream that ended since its worker's report (`LoadTracker.blocks_freed_since`)."""

    instance: str
    nth: int


def freed_at(instance: str, trailing: Trailing) -> FreedAt | None:
    """The stream's end in its worker's frees, from its call's trailing metadata; None where the worker did not say
    (an earlier build, a stream cancelled or failed: the router's clock decides for it)."""
    said = dict(trailing or ()).get(SEQUENCES_FREED_KEY)
    if isinstance(said, str) and said.isdigit() and instance:
        return FreedAt(instance, int(said))
    return None
