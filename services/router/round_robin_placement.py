"""The baseline placement policy (`--policy round-robin`) the SLO-aware one is measured against."""

from __future__ import annotations

import itertools

from pdserve.registry.base import PrefixIndex, Registry, WorkerState
from services.router.ejection import Ejections
from services.router.placement import Ask, PlacementPolicy
from services.router.predictor import Predictor


class RoundRobinPlacement(PlacementPolicy):
    """Each role in turn, blind to load and cache: the baseline placement is compared against."""

    def __init__(
        self,
        registry: Registry,
        prefix_index: PrefixIndex,
        predictor: Predictor,
        ejections: Ejections | None = None,
        tokenizer: str = "",
    ) -> None:
        super().__init__(registry, prefix_index, predictor, ejections, tokenizer)
        self._turn = itertools.count()

    def choose(
        self, prefills: list[WorkerState], decodes: list[WorkerState], ask: Ask
    ) -> tuple[WorkerState, WorkerState]:
        turn = next(self._turn)
        prefills, decodes = sorted(prefills, key=lambda w: w.worker_id), sorted(decodes, key=lambda w: w.worker_id)
        return prefills[turn % len(prefills)], decodes[turn % len(decodes)]
