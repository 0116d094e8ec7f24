"""The worker registry interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str  # "prefill", "decode" or "colocated"
    address: str  # host:port of its gRPC server
    model_fingerprint: str = ""


class Registry(ABC):
    @abstractmethod
    def register(self, worker: WorkerInfo) -> None:
        """Called by whoever started the worker, once it serves (and again after a restart moved it)."""

    @abstractmethod
    def deregister(self, worker_id: str) -> None:
        """Called when a worker is stopped or found dead; routers stop placing on it."""

    @abstractmethod
    def workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Called by routers on every placement: the live workers, optionally of one role."""
