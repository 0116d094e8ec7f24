"""Per-request sampling settings, validated once when the request enters."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy; top_k 0 means off."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if math.isnan(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be a number >= 0, got {self.temperature}")
        if math.isnan(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
