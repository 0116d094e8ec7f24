"""A prefill and a decode worker in the test's own process (gRPC on loopback, the KV transfer over torch.distributed,
engine threads): called as a router calls them, or put behind a router the test starts itself."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from unittest import mock

from pdserve.cluster.worker_runtime import WorkerRuntime
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import EngineConfig
from pdserve.env import CLUSTER_SECRET_VAR
from services.workers import add_worker_services

TINY = EngineConfig(model="tiny-random", num_threads=1, kv_cache_memory_gb=0.05)


@contextmanager
def in_process_workers(
    name: str, faults: Mapping[str, str] | None = None, engine: EngineConfig = TINY
) -> Iterator[tuple[WorkerRuntime, WorkerRuntime]]:
    """(prefill, decode), serving, ids `<name>-prefill` and `<name>-decode`, without cluster credentials; the fault
    knobs `faults` (PDSERVE_FAULT_*) set while they run, stopped at the end."""
    with mock.patch.dict(os.environ, faults or {}):
        os.environ.pop(CLUSTER_SECRET_VAR, None)
        prefill = WorkerRuntime(WorkerSpec("prefill", engine, worker_id=f"{name}-prefill"), add_worker_services)
        decode = WorkerRuntime(WorkerSpec("decode", engine, worker_id=f"{name}-decode"), add_worker_services)
        try:
            prefill.address(120), decode.address(120)
            yield prefill, decode
        finally:
            decode.stop()
            prefill.stop()
