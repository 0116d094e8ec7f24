"""A cluster's split of its workers: P prefill and D decode, or N colocated; what the planner simulates and
recommends."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    prefill: int = 0
    decode: int = 0
    colocated: int = 0

    def __post_init__(self) -> None:
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("a shape is either colocated or disaggregated")
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise ValueError(f"a disaggregated shape needs both roles, got {self.prefill}:{self.decode}")

    @property
    def label(self) -> str:
        return f"{self.colocated} colocated" if self.colocated else f"{self.prefill}P:{self.decode}D"
