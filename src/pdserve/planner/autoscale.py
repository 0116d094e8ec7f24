"""`pdserve autoscale`'s decisions, apart from any I/O: the load a router admitted over a window, the split the
planner recommends for it, and when a new recommendation becomes a scale.

The load comes from the router's cumulative admitted counters (requests, prompt tokens, max_tokens): differences
over the window give the arrival rate and the mean prompt and output lengths. The recommendation re-plans that
load with the planner's simulator: the fewest workers (2 up to the cap) whose best split sustains the observed
rate at the SLO attainment target, and that split; an idle window recommends the smallest cluster, one worker per
role. A recommendation becomes a scale only after it came `consecutive` times in a row (one busy window is not
a trend) and the last scale is `cooldown_s` old (a scale changes the load each worker sees, and new workers need
time to warm up before their effect shows).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from pdserve.planner import workload
from pdserve.planner.hardware import HardwareProfile
from pdserve.planner.plan import SLO, max_rate
from pdserve.planner.simulator import Shape

SMALLEST = {"prefill": 1, "decode": 1}
PLAN_REQUESTS = 200  # requests per simulated run: enough for a p90, few enough to re-plan every interval


@dataclass(frozen=True)
class Admitted:
    """A router's cumulative admitted counters at one moment."""

    at_s: float
    requests: int
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Load:
    rate: float  # requests/s admitted over the window
    input_len: float  # mean prompt tokens of those requests (0 when none came)
    output_len: float  # mean max_tokens of those requests

    @property
    def idle(self) -> bool:
        return self.rate <= 0


@dataclass
class LoadWindow:
    """The samples of the last `window_s` seconds (and the one just before, so the window is covered whole)."""

    window_s: float
    samples: deque[Admitted] = field(default_factory=deque)

    def observe(self, sample: Admitted) -> None:
        if self.samples and sample.requests < self.samples[-1].requests:  # the router restarted: counts from 0
            self.samples.clear()
        self.samples.append(sample)
        while len(self.samples) > 2 and sample.at_s - self.samples[1].at_s >= self.window_s:
            self.samples.popleft()

    def load(self) -> Load | None:
        """None until the samples span the window."""
        if len(self.samples) < 2 or self.samples[-1].at_s - self.samples[0].at_s < self.window_s:
            return None
        first, last = self.samples[0], self.samples[-1]
        n = last.requests - first.requests
        rate = n / (last.at_s - first.at_s)
        if n == 0:
            return Load(0.0, 0.0, 0.0)
        return Load(rate, (last.prompt_tokens - first.prompt_tokens) / n, (last.max_tokens - first.max_tokens) / n)


def recommend_counts(
    profile: HardwareProfile, load: Load, slo: SLO, max_workers: int, num_requests: int = PLAN_REQUESTS
) -> dict[str, int]:
    """The split of the fewest workers (2..max_workers) that sustains `load` at the SLO: the split with the highest
    sustainable rate at that size. None sustains it: the best split of `max_workers`."""
    if max_workers < 2:
        raise ValueError(f"--max-workers must be at least 2 (a prefill and a decode worker), got {max_workers}")
    if load.idle:
        return dict(SMALLEST)
    lengths = max(1, round(load.input_len)), max(1, round(load.output_len))
    work = workload.synthetic(load.rate, *lengths, num_requests=num_requests)
    best: tuple[float, Shape] = (-math.inf, Shape(1, 1))
    for k in range(2, max_workers + 1):
        best = max((max_rate(profile, s, work, slo), s) for s in _splits(k))
        if best[0] >= load.rate:
            break
    return {"prefill": best[1].prefill, "decode": best[1].decode}


def _splits(workers: int) -> list[Shape]:
    return [Shape(prefill=p, decode=workers - p) for p in range(1, workers)]


def bounded(counts: dict[str, int], max_workers: int) -> dict[str, int]:
    """At least one worker per role and at most `max_workers` in all (the larger role gives way first)."""
    prefill, decode = max(1, counts.get("prefill", 1)), max(1, counts.get("decode", 1))
    while prefill + decode > max(2, max_workers):
        if prefill >= decode:
            prefill -= 1
        else:
            decode -= 1
    return {"prefill": prefill, "decode": decode}


@dataclass(frozen=True)
class Decision:
    target: dict[str, int] | None  # the counts to scale to now; None: hold
    why: str


@dataclass
class Hysteresis:
    """Acts on a recommendation that differs from the current counts only after `consecutive` in a row, and only
    once `cooldown_s` passed since the last change it made."""

    consecutive: int
    cooldown_s: float
    _pending: dict[str, int] | None = None
    _streak: int = 0
    _changed_at_s: float = -math.inf

    def decide(self, now_s: float, current: dict[str, int], recommended: dict[str, int]) -> Decision:
        if recommended == current:
            self._pending, self._streak = None, 0
            return Decision(None, "at the recommendation")
        if recommended == self._pending:
            self._streak += 1
        else:
            self._pending, self._streak = dict(recommended), 1
        if self._streak < self.consecutive:
            return Decision(None, f"recommended {self._streak} of {self.consecutive} times in a row")
        left = self.cooldown_s - (now_s - self._changed_at_s)
        if left > 0:
            return Decision(None, f"cooling down for {left:.1f} s more")
        self._pending, self._streak, self._changed_at_s = None, 0, now_s
        return Decision(dict(recommended), "recommended consistently")
