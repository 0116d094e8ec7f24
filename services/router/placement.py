"""Choosing the workers for one request. Least loaded here; SLO-aware placement builds on the same interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass

from pdserve.errors import UnavailableError
from pdserve.registry.base import Registry, WorkerInfo


@dataclass(frozen=True)
class Placement:
    decode: WorkerInfo  # the worker whose stream the router relays (a colocated worker in colocated mode)
    prefill: WorkerInfo | None  # None: the decode worker prefills itself (colocated)


class PlacementPolicy(ABC):
    @abstractmethod
    def place(self, prompt_tokens: int) -> Placement:
        """Called by the router for each admitted request; raises UnavailableError when no worker fits."""

    @abstractmethod
    def release(self, placement: Placement) -> None:
        """Called by the router when the request's stream ends, however it ends."""


class LeastLoadedPlacement(PlacementPolicy):
    """Fewest requests in flight from this router, per role; ties go to the first registered."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._in_flight: Counter[str] = Counter()

    def place(self, prompt_tokens: int) -> Placement:
        colocated = self.registry.workers("colocated")
        if colocated:
            return Placement(decode=self._least_loaded(colocated), prefill=None)
        prefill, decode = self.registry.workers("prefill"), self.registry.workers("decode")
        if not prefill or not decode:
            raise UnavailableError(f"no workers to serve: {len(prefill)} prefill, {len(decode)} decode registered")
        placement = Placement(decode=self._least_loaded(decode), prefill=self._least_loaded(prefill))
        return placement

    def _least_loaded(self, workers: list[WorkerInfo]) -> WorkerInfo:
        chosen = min(workers, key=lambda w: self._in_flight[w.worker_id])
        self._in_flight[chosen.worker_id] += 1
        return chosen

    def release(self, placement: Placement) -> None:
        for worker in (placement.decode, placement.prefill):
            if worker is not None:
                self._in_flight[worker.worker_id] -= 1
