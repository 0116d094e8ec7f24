"""The baseline placement policy (`--policy round-robin`) the SLO-aware one is measured against."""

from __future__ import annotations

import itertools
from typing import Any

from pdserve.registry.base import WorkerState
from services.router.placement import Ask, PlacementPolicy


class RoundRobinPlacement(PlacementPolicy):
    """Each role in turn, blind to load and cache: the baseline placement is compared against."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """PlacementPolicy's arguments."""
        super().__init__(*args, **kwargs)
        self._turn = itertools.count()

    def choose(
        self, prefills: list[WorkerState], decodes: list[WorkerState], ask: Ask
    ) -> tuple[WorkerState, WorkerState]:
        turn = next(self._turn)
        prefills, decodes = sorted(prefills, key=lambda w: w.worker_id), sorted(decodes, key=lambda w: w.worker_id)
        return prefills[turn % len(prefills)], decodes[turn % len(decodes)]
