"""A prefill and a decode worker in the test's own process (gRPC on loopback, the KV transfer over torch.distributed,
engine threads): called as a router calls them, or put behind a real router in the same process."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from unittest import mock

from pdserve.cluster.worker_runtime import WorkerRuntime
from pdserve.cluster.worker_spec import WorkerSpec
from pdserve.config import EngineConfig, RouterConfig
from pdserve.env import CLUSTER_SECRET_VAR
from pdserve.registry.memory import InMemoryPrefixIndex, InMemoryRegistry
from pdserve.telemetry import Telemetry
from services.router.lifecycle import RequestLifecycle
from services.router.server import RouterServer, start_router
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


@asynccontextmanager
async def router_over(
    workers: tuple[WorkerRuntime, ...], config: RouterConfig | None = None, http_port: int | None = None
) -> AsyncIterator[tuple[RouterServer, RequestLifecycle]]:
    """A tiny-random router whose registry the workers' states are published into every 0.1 s, as a launcher's
    heartbeat does. `http_port`: as start_router's."""
    registry = InMemoryRegistry(ttl_s=600)

    async def publish() -> None:
        while True:
            for w in workers:
                registry.publish(w.state())
            await asyncio.sleep(0.1)

    for w in workers:
        registry.publish(w.state())
    publishing = asyncio.ensure_future(publish())
    telemetry = Telemetry("pdserve-router", enabled=False)
    server, lifecycle = await start_router(
        "tiny-random",
        registry,
        InMemoryPrefixIndex(),
        config or RouterConfig(),
        "127.0.0.1",
        0,
        telemetry,
        http_port=http_port,
    )
    try:
        yield server, lifecycle
    finally:
        await server.stop(None)
        publishing.cancel()
