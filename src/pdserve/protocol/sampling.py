"""Per-request sampling settings. Constructing one checks every rule on its fields: this is the one definition
of what a valid SamplingParams is, wherever a request enters (router, worker, `pdserve generate`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy; top_k 0 means off.

    Errors name the public API's field (`sampling.top_p`), so a client reads the same message from any entry.
    """

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
            raise InvalidRequestError("sampling.max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("sampling.temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError("sampling.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("sampling.stop", "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
