"""The embedded registry of a local cluster with one router: a dict in the router's process."""

from __future__ import annotations

import threading

from pdserve.registry.base import Registry, WorkerInfo


class InMemoryRegistry(Registry):
    def __init__(self) -> None:
        self._workers: dict[str, WorkerInfo] = {}
        self._lock = threading.Lock()

    def register(self, worker: WorkerInfo) -> None:
        with self._lock:
            self._workers[worker.worker_id] = worker

    def deregister(self, worker_id: str) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)

    def workers(self, role: str | None = None) -> list[WorkerInfo]:
        with self._lock:
            return [w for w in self._workers.values() if role is None or w.role == role]
