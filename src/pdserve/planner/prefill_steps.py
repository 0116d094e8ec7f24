"""What a prefill worker's next step runs, as its engine's scheduler (engine/scheduler.py) picks it with the settings
its role gets (cluster/worker_spec.py `role_scheduler`): one prompt a step, a long one a chunk at a time, and where
the role runs short prompts first, a waiting prompt that fits one step ahead of a longer prompt's next chunk, by
the engine's own rule and credit (engine/short_first.py `ShortFirst`). The simulator has no priority classes or
tenants (every request at the default), so short prompts go ahead in the order they came.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from pdserve.config import SchedulerConfig
from pdserve.engine.short_first import ShortFirst
from pdserve.planner.workload import SimRequest


class Queued(Protocol):
    """A prompt queued on the worker, waiting (none of it prefilled) or part-way through its chunks."""

    @property
    def req(self) -> SimRequest: ...
    @property
    def prefilled(self) -> int: ...
    @property
    def priority(self) -> int: ...


Q = TypeVar("Q", bound=Queued)


def left(prompt: Queued) -> int:
    """Its new tokens still to compute (the simulator has no prefix cache: the whole prompt, at first)."""
    return prompt.req.input_len - prompt.prefilled


class PrefillSteps(Generic[Q]):
    def __init__(self, scheduler: SchedulerConfig) -> None:
        assert scheduler.max_prefills_per_step == 1, "a prefill worker runs one prompt a step"
        self.budget = min(scheduler.max_num_batched_tokens, scheduler.long_prefill_chunk)
        self.order = ShortFirst[Q](scheduler.long_prefill_chunk, left) if scheduler.short_prompts_first else None

    def next(self, queue: Iterable[Q], start: Callable[[Q], bool]) -> tuple[Q, int] | None:
        """The one prompt chunk of the next step, and its tokens; None: nothing can run. `start` reserves a waiting
        prompt's place and KV, False where there is no room (as the engine's scheduler admits one)."""
        started = [s for s in queue if s.prefilled]
        waiting = [s for s in queue if not s.prefilled]
        ahead = self._ahead(started, waiting)
        if ahead and start(ahead[0]):
            prompt = ahead[0]
        elif started:  # part-way: its next chunk (also where the prompt going ahead found no room)
            prompt = started[0]
        elif waiting and not ahead and start(waiting[0]):
            prompt = waiting[0]
        else:
            return None
        n = min(left(prompt), self.budget)
        if self.order:
            self.order.ran(n, prompt in ahead, prompt.req.input_len)
        return prompt, n

    def _ahead(self, started: list[Q], waiting: list[Q]) -> list[Q]:
        """The waiting prompts that may run ahead of a longer prompt's chunks (Scheduler._short_ahead)."""
        if self.order is None or not waiting:
            return []
        longer = started + [s for s in waiting if not self.order.fits(s)]
        return self.order.pick(waiting, longer)
