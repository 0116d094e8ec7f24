"""What the simulated router counts on one prefill worker, and the wait it predicts there for a new prompt: the
prompts it placed there whose first token is not out, each at its prefill time by the profile
(services/router/load_tracker.py, predictor.py). It routes a prompt to the worker of the least such wait and sheds
by it (admission_model.py).

Where the worker runs a prompt that fits one step ahead of longer prompts' remaining chunks (engine/short_first.py),
the router prices such a prompt's wait as the short prompts placed there plus one chunk's share of a longer one, the
chunk it may find in flight (`LoadTracker.pending_ahead_of_short_s`; a worker's report, which a simulation has
none of, measures that chunk instead); a longer prompt waits for them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.protocol.perf_profile import PerfProfile


@dataclass
class PlacedPrompts:
    perf: PerfProfile
    short_tokens: int  # a prompt of at most this many new tokens goes ahead of longer ones; 0: all in order
    tokens: int = 0  # of every prompt placed here, what the router's queue bound counts
    prompts: int = 0
    seconds: float = 0.0  # their prefill time by the profile, summed
    short_s: float = 0.0  # of those that go ahead of longer ones
    longer: list[int] = field(default_factory=list)  # the new tokens of each longer one

    def place(self, new_tokens: int) -> None:
        self._count(new_tokens, +1)

    def first_token(self, new_tokens: int) -> None:
        """The prompt's first token reached the caller: the router stops counting it (LoadTracker.prefilled)."""
        self._count(new_tokens, -1)

    def _count(self, new_tokens: int, sign: int) -> None:
        seconds = sign * self.perf.prefill_s(new_tokens)
        self.tokens, self.prompts = self.tokens + sign * new_tokens, self.prompts + sign
        if not self.prompts:  # none left: exactly idle, so rounding leaves no idle worker looking busier than another
            self.seconds = self.short_s = 0.0
            self.longer.clear()
            return
        self.seconds += seconds
        if new_tokens <= self.short_tokens:
            self.short_s += seconds
        elif sign > 0:
            self.longer.append(new_tokens)
        else:
            self.longer.remove(new_tokens)

    def wait_s(self, new_tokens: int) -> float:
        """The predicted wait here of a prompt of `new_tokens` (0: any prompt, all of the queue)."""
        if not 0 < new_tokens <= self.short_tokens:
            return self.seconds
        chunk_s = max((self.perf.prefill_s(n) * self.short_tokens / n for n in self.longer), default=0.0)
        return self.short_s + chunk_s
